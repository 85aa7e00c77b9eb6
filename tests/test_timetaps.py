"""Jit-event and trace-time taps (``jit_events``, ``trace_events``,
``max_compiles``) and the timeline they feed."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap
from jaxtap import _seam


def compiles(rec):
    return [e for e in rec.events if e.kind == "compile"]


def traces(rec):
    return [e for e in rec.events if e.kind == "trace"]


def g(x):
    return jnp.sin(x) * 2.0


# ------------------------------------------------------------------ jit events
def test_a_new_shape_compiles_once_more_and_names_the_argument():
    jg = jax.jit(g)
    with tap.record(jit_events=True) as rec:
        jg(jnp.ones(4, jnp.float32))
        jg(jnp.ones(8, jnp.float32))
        jg(jnp.ones(8, jnp.float32))
    first, second = compiles(rec)  # exactly two
    line = g.__code__.co_firstlineno
    assert first.path == second.path == f"jit(g)@test_timetaps.py:{line}"
    assert (first.step, second.step) == (0, 1)
    assert first.total is None
    assert first.value["reason"] == "first compile in this scope"
    assert second.value["reason"] == "x: f32[8] (was f32[4])"
    assert second.value["signature"] == "x: f32[8]"
    for e in (first, second):
        v = e.value
        assert all(isinstance(v[k], float) and v[k] >= 0 for k in ("trace_s", "lower_s", "compile_s"))
        assert v["cache"] in ("off", "hit", "miss")
        assert v["eqns"] == 2  # sin, mul
        assert v["cost"] is None or v["cost"]["transcendentals"] == {0: 4.0, 1: 8.0}[e.step]  # XLA's count


def test_a_python_float_then_a_float32_names_the_weak_type():
    jg = jax.jit(g)
    with tap.record(jit_events=True) as rec:
        jg(1.0)
        jg(jnp.float32(1.0))
    first, second = compiles(rec)
    assert first.value["signature"] == "x: f32[] weak"
    assert second.value["reason"] == "x: f32[] (was f32[] weak)"


def test_static_arguments_pytrees_and_config_are_named():
    def h(x, n, tree):
        return x * n + tree["a"]

    jh = jax.jit(h, static_argnums=1)
    a = jnp.ones(3)
    with tap.record(jit_events=True) as rec:
        jh(a, 2, {"a": a})
        jh(a, 3, {"a": a})
        jh(a, 3, {"a": jnp.ones(3, jnp.int32)})
        with jax.default_matmul_precision("highest"):
            jh(a, 3, {"a": jnp.ones(3, jnp.int32)})
    reasons = [e.value["reason"] for e in compiles(rec)]
    assert reasons[1] == "n: static 3 (was static 2)"
    assert reasons[2] == "tree['a']: i32[3] (was f32[3])"
    assert reasons[3].startswith("JAX config changed")


def test_a_function_jitted_anew_each_call_is_called_out():
    with tap.record(jit_events=True) as rec:
        for _ in range(2):
            jax.jit(lambda x: x + 1.0)(jnp.ones(2))
    evs = compiles(rec)
    assert [e.step for e in evs] == [0, 1]
    assert "new function object" in evs[1].value["reason"]


def test_no_event_for_eager_ops_cache_hits_or_outside_the_block():
    def g(x):
        return jnp.sin(x) - 1.0

    jg = jax.jit(g)
    jg(jnp.ones(3))  # compiled before the block
    with tap.record(jit_events=True, ops=()) as rec:
        jnp.sin(jnp.ones(5)) + 1.0  # eager ops: JAX's own jits
        jg(jnp.ones(3))  # a cache hit: jit events alone keep the jit key
        jg(jnp.ones(4))  # compiles
    jg(jnp.ones(6))
    assert [(e.step, e.value["signature"]) for e in compiles(rec)] == [(0, "x: f32[4]")]
    with tap.record(jit_events=True) as rec:  # runtime taps re-key: compiled before means compiled again
        jg(jnp.ones(3))
    assert [e.value["reason"] for e in compiles(rec)] == ["first compile in this scope"]


def test_transformed_ahead_of_time_and_callable_jits_are_attributed():
    def h(x):
        return jnp.sin(x) * 3.0

    def k(x):
        return jnp.cos(x) * 3.0

    class Model:
        def __call__(self, x):
            return jnp.tanh(x) * 3.0

    def ctev(x):
        with jax.ensure_compile_time_eval():
            t = jnp.cos(jnp.arange(5.0)) * 3.0  # eager ops while ctev is traced
        return x + t

    with tap.record(jit_events=True, ops=()) as rec:
        jax.vmap(jax.jit(h))(jnp.ones((2, 3)))
        lh, lk = jax.jit(h).lower(jnp.ones(7)), jax.jit(k).lower(jnp.ones(7))
        lk.compile()
        lh.compile()
        jax.jit(Model())(jnp.ones(3))
        jax.jit(ctev)(jnp.ones(5))
    got = [(e.path.split("@")[0], e.value["signature"]) for e in compiles(rec)]
    assert got == [("jit(h)", "x: f32[3]"),  # as the vmapped function sees it
                   ("jit(k)", "x: f32[7]"), ("jit(h)", "x: f32[7]"),
                   ("jit(Model)", "x: f32[3]"), ("jit(ctev)", "x: f32[5]")]
    assert compiles(rec)[0].value["reason"].startswith("a transformed program")
    assert all("@test_timetaps.py:" in e.path for e in compiles(rec))


def test_reasons_for_a_keyword_argument_a_long_static_value_and_the_same_function():
    def m(x, cfg=()):
        return x * len(cfg)

    jm = jax.jit(m, static_argnames="cfg")
    x = jnp.ones(3)
    with tap.record(jit_events=True, ops=()) as rec:
        jm(x, cfg=tuple(range(30)) + (1,))
        jm(x, cfg=tuple(range(30)) + (2,))  # differs past the repr's first 60 characters
        jm(x=x, cfg=tuple(range(30)) + (2,))
    reasons = [e.value["reason"] for e in compiles(rec)]
    assert reasons[1].startswith("cfg: a different static value")
    assert reasons[2] == "x: f32[3] by keyword (was f32[3])"
    jax.clear_caches()
    with tap.record(jit_events=True, ops=()) as rec:
        jm(x, cfg=(1,))
        jax.clear_caches()
        jm(x, cfg=(1,))
    assert compiles(rec)[1].value["reason"].startswith("same function, arguments and config")


def test_cache_outcome_is_off_without_a_cache_directory():
    assert jax.config.jax_compilation_cache_dir is None
    with tap.record(jit_events=True, ops=()) as rec:
        jax.jit(lambda x: x * 7.0)(jnp.ones(2))
    assert [e.value["cache"] for e in compiles(rec)] == ["off"]


def test_max_compiles_prints_one_fail_line_with_the_reason(capfd):
    def g(x):  # its own function: JAX shares compilations of one function between jit objects
        return jnp.sin(x) * 2.0

    jg = jax.jit(g)
    with tap.record(max_compiles=2, ops=()) as rec:
        for n in (1, 2, 3, 4):
            jg(jnp.ones(n))
    err = capfd.readouterr().err
    fails = [line for line in err.splitlines() if line.startswith("[tap] FAIL")]
    line = g.__code__.co_firstlineno
    assert fails == [f"[tap] FAIL jit(g)@test_timetaps.py:{line} compiled 3 times: x: f32[3] (was f32[2])"]
    assert len(compiles(rec)) == 4


def test_wrapped_functions_report_the_jits_they_call():
    def g(x):
        return jnp.cos(x)

    jg = jax.jit(g)
    seen = []
    f = tap.verbose(lambda x: jg(x) + 1.0, on_step=seen.append, jit_events=True)
    f(jnp.ones(2))
    f(jnp.ones(2))
    f(jnp.ones(7))
    # the wrapper counts compilations over its life (a storm spans calls)
    assert [(e.kind, e.step) for e in seen] == [("compile", 0), ("compile", 1)]
    assert seen[1].value["reason"] == "x: f32[7] (was f32[2])"


def test_listeners_and_patches_are_removed_one_by_one_also_on_errors():
    from jax._src import compiler, monitoring, pjit
    mine = lambda *a, **k: None  # noqa: E731 - someone else's listener stays
    jax.monitoring.register_event_listener(mine)
    before = (list(monitoring._event_listeners), list(monitoring._event_time_span_listeners),
              pjit._infer_params, compiler.compile_or_get_cached)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with tap.record(jit_events=True, trace_events=True):
                jax.jit(g)(jnp.ones(2))
                raise RuntimeError("boom")
        after = (list(monitoring._event_listeners), list(monitoring._event_time_span_listeners),
                 pjit._infer_params, compiler.compile_or_get_cached)
        assert after == before
        from jax._src.lax.control_flow import loops
        assert not getattr(loops._promote_weak_typed_input, "__name__", "") == "_promote"
    finally:
        monitoring._event_listeners.remove(mine)


def test_a_raising_consumer_does_not_disturb_the_program():
    def bad(e):
        raise ValueError("consumer bug")

    def g(x):
        return jnp.tan(x)

    jg = jax.jit(g)
    with pytest.warns(tap.TapWarning, match="consumer bug"):
        with tap.record(jit_events=True, on_step=bad, ops=()):
            out = jg(jnp.ones(3))
    assert np.array_equal(out, g(jnp.ones(3)))


@pytest.mark.parametrize("kw, err", [(dict(max_compiles=0), ValueError), (dict(jit_events="yes"), TypeError),
                                     (dict(trace_events=None), TypeError)])
def test_bad_options_fail_before_running(kw, err):
    with pytest.raises(err, match="jax-tap"):
        tap.record(**kw)
    with pytest.raises(err, match="jax-tap"):
        tap.TapContext(**kw)


# ---------------------------------------------------------------- trace events
def make_nested():
    """A fresh function each call (JAX caches traces per function object)."""
    def nested(x):
        return _nested(x)
    return nested


def _nested(x):
    def inner(c):
        return jax.lax.scan(lambda a, _: (a * 1.01, None), c, None, length=2)[0]

    def body(c, _):
        c = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, jax.jit(inner)(s[1])), (0, c))[1]
        c = jax.lax.cond(c > 0, lambda c: jax.lax.fori_loop(0, 2, lambda i, a: a + 1.0, c), lambda c: c, c)
        return c, None

    return jax.lax.scan(body, x, None, length=2)[0]


def test_trace_events_sit_at_the_runtime_addresses():
    with tap.record(trace_events=True) as rec:
        jax.jit(make_nested())(1.0)
    at_trace = [e.path for e in traces(rec)]
    assert at_trace == ["scan[0]", "scan[0]/while[0]", "scan[0]/while[0]/jit[0]/scan[0]", "scan[0]/scan[0]"]
    assert set(at_trace) == {e.path for e in rec.events if e.kind == "carry"}
    top = traces(rec)[0].value
    assert top["carry"] == ["f32[] weak"] and top["weak_promoted"] == 0 and top["traces"] == 1
    assert top["eqns"] > traces(rec)[1].value["eqns"] > 0


def test_a_promotion_in_a_custom_rule_body_is_not_given_to_another_loop():
    bf = jnp.bfloat16

    def helper(c):
        return jax.lax.scan(lambda d, _: (d + jnp.ones((), bf), None), c, None, length=2)[0]

    @jax.custom_jvp
    def cj(x):
        return helper(0.0) + x  # promoted here, in a custom rule's body (no trace event)

    cj.defjvp(lambda p, t: (cj(p[0]), t[0]))
    with tap.record(trace_events=True, ops=()) as rec:
        jax.jit(lambda x: cj(x) + helper(x))(bf(1))
    assert [(e.path, e.value["weak_promoted"]) for e in traces(rec)] == [("scan[0]", 0)]


def test_a_weak_carry_promoted_by_the_body_is_reported_and_retracing_counts():
    def f(x):  # 0.0 is weakly typed; the body makes it bfloat16: JAX traces the body twice
        return jax.lax.scan(lambda c, _: (c + jnp.ones((), jnp.bfloat16), None), 0.0, None, length=2)[0] + x

    with tap.record(trace_events=True, ops=()) as rec:
        jax.jit(f)(jnp.bfloat16(1))
        jax.jit(f)(jnp.ones(2, jnp.bfloat16))  # traced again
    first, second = traces(rec)
    assert (first.path, first.step, second.step) == ("scan[0]", 0, 1)
    assert first.value["weak_promoted"] == 1 and first.value["carry"] == ["bf16[]"]
    assert second.value["traces"] == 2


def test_trace_events_alone_leave_the_lowered_program_byte_identical():
    x = jnp.float32(1.0)
    clean = jax.jit(make_nested()).lower(x).as_text()
    with tap.record(trace_events=True, ops=()) as rec:
        tapped = jax.jit(make_nested()).lower(x).as_text()
    assert len(traces(rec)) == 4
    assert tapped == clean


# ------------------------------------------------------------------- timeline
def validate_timeline(path):
    """The trace-event format's rules this file must keep (Chrome's
    "Trace Event Format" document): required fields, balanced complete
    spans, timestamps monotonic per track."""
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    events = doc["traceEvents"]
    last = {}
    for ev in events:
        assert {"name", "ph", "pid", "tid", "ts"} <= set(ev), ev
        assert ev["ph"] in ("X", "C", "i", "M"), ev
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        if ev["ph"] == "X":
            assert ev["dur"] >= 0
        if ev["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in ev["args"].values())
        if ev["ph"] != "M":
            track = (ev["pid"], ev["tid"])
            assert ev["ts"] >= last.get(track, 0.0), "timestamps go back on a track"
            last[track] = ev["ts"]
    return events


def test_timeline_holds_compile_spans_loop_counters_and_instants(tmp_path):
    jn = jax.jit(make_nested())
    with tap.record(jit_events=True, trace_events=True, select=lambda leaves: ()) as rec:
        jn(1.0)
        jn(jnp.float32(1.0))  # strong: compiles and traces again
    path = tmp_path / "run.trace.json"
    rec.timeline(path)
    events = validate_timeline(path)
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["phase"] for e in spans} == {"trace", "lower", "compile"}
    assert len([e for e in spans if e["args"]["phase"] == "compile"]) == 2
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"scan[0]", "scan[0]/while[0]", "scan[0]/while[0]/jit[0]/scan[0]", "scan[0]/scan[0]"}
    instants = [e["name"] for e in events if e["ph"] == "i"]
    assert sum(n.startswith("compile ") for n in instants) == 2 and sum(n.startswith("trace ") for n in instants) == 8
    # a span starts before the loop's first step arrives
    first_compile = min(e["ts"] for e in spans)
    assert first_compile < min(e["ts"] for e in events if e["ph"] == "C")
    # a recorder of such a block pickles (its jit-event taps held the live
    # block's sink), and its copy writes the same timeline
    import pickle
    back = pickle.loads(pickle.dumps(rec))
    back.timeline(tmp_path / "back.trace.json")
    assert validate_timeline(tmp_path / "back.trace.json") == events and len(back) == len(rec)


def test_timeline_of_a_wrapper_keeps_every_call(tmp_path):
    f, rec = tap.record(jax.jit(lambda x: jnp.sin(x) + 4.0), jit_events=True, ops=())
    f(jnp.ones(3))
    f(jnp.ones(4))
    rec.timeline(tmp_path / "w.json")
    spans = [e for e in validate_timeline(tmp_path / "w.json") if e["ph"] == "X"]
    assert len(spans) == 6 and [e.step for e in compiles(rec)] == [0, 1]


def test_summary_time_is_the_union_of_overlapping_spans():
    from jaxtap._cli import _covered
    spans = [(1, "a", "trace", 0.0, 2.0), (2, "b", "compile", 1.0, 3.0), (1, "c", "compile", 5.0, 6.0),
             (1, "c", "alert", 5.5, "[tap] FAIL ...")]
    assert _covered(spans) == 4.0


def test_timeline_without_times_has_the_spans_only(tmp_path):
    with tap.record(select=lambda leaves: ()) as rec:
        jax.jit(make_nested())(1.0)
    rec.timeline(tmp_path / "t.json")
    assert [e for e in validate_timeline(tmp_path / "t.json") if e["ph"] != "M"] == []


def test_timeline_of_a_users_own_recorder_given_as_on_step(tmp_path):
    # timeline=True keeps arrival times in the block's recorder and in a
    # FlightRecorder the user passes as on_step (its timeline() needs them)
    mine, theirs = tap.FlightRecorder(), tap.FlightRecorder()
    with tap.record(timeline=True, on_step=mine, select=lambda leaves: ()) as rec:
        jax.jit(make_nested())(1.0)
    with tap.record(on_step=theirs, select=lambda leaves: ()):  # no timeline: no times kept
        jax.jit(make_nested())(1.0)
    for r, name in ((rec, "block"), (mine, "mine"), (theirs, "theirs")):
        r.timeline(tmp_path / f"{name}.json")
    counters = {n: [e for e in validate_timeline(tmp_path / f"{n}.json") if e["ph"] == "C"] for n in ("block", "mine", "theirs")}
    assert len(mine) == len(rec) > 0 and len(counters["mine"]) == len(counters["block"]) > 0
    assert counters["theirs"] == []
    g = tap.verbose(make_nested(), on_step=(own := tap.FlightRecorder()), timeline=True, select=lambda leaves: ())
    g(1.0)
    own.timeline(tmp_path / "verbose.json")
    assert len(own) > 0 and [e for e in validate_timeline(tmp_path / "verbose.json") if e["ph"] == "C"]


# ------------------------------------------------------------------------ CLI
STORM = textwrap.dedent("""
    import jax, jax.numpy as jnp

    @jax.jit
    def step(w, x):
        return jax.lax.fori_loop(0, 10, lambda i, w: w - 0.01 * (w - x.mean()), w)

    w = jnp.float32(0.0)
    for epoch in range(4):
        w = step(w, jnp.ones(10 + epoch))
    print("w", float(w))
""")


def test_cli_jit_events_summary_fail_line_and_timeline(tmp_path):
    (tmp_path / "train.py").write_text(STORM)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "jaxtap", "--summary", "--max-compiles", "2", "--timeline",
                        "run.json", "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("w ")
    fails = [line for line in r.stderr.splitlines() if line.startswith("[tap] FAIL")]
    assert fails == ["[tap] FAIL jit(step)@train.py:4 compiled 3 times: x: f32[12] (was f32[11])"]
    assert "compilations: 4 of 1 jitted functions" in r.stderr
    assert "jit(step)@train.py:4  x4" in r.stderr
    assert "tracing+lowering+compiling:" in r.stderr
    events = validate_timeline(tmp_path / "run.json")
    assert len([e for e in events if e["ph"] == "X" and e["args"]["phase"] == "compile"]) == 4
    assert {e["name"] for e in events if e["ph"] == "C"} == {"scan[0]"}
    markers = [e["name"] for e in events if e["ph"] == "i" and e.get("s") == "g"]
    assert markers == fails


def test_compile_and_trace_events_round_trip_through_jsonl(tmp_path):
    path = tmp_path / "run.jsonl"
    with tap.record(jit_events=True, trace_events=True, on_step=tap.JSONLWriter(path), ops=()) as rec:
        jax.jit(make_nested())(1.0)
    back = tap.read_jsonl(path)
    assert [(e.path, e.step, e.kind) for e in back] == [(e.path, e.step, e.kind) for e in rec.events]
    assert back[-1].kind == "compile" and back[-1].value["reason"] == "first compile in this scope"


def test_seam_names_the_internals_it_reads():
    m = _seam.monitor
    assert m.TRACE_SPAN.startswith("/jax/") and m.COMPILE_SPAN.startswith("/jax/")
    from jax._src import pjit
    from jax._src.lax.control_flow import loops
    assert callable(pjit._infer_params) and callable(loops._promote_weak_typed_input)
