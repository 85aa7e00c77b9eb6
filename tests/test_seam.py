"""The jax-internals seam: every assumption jax-tap makes about JAX's
internals, checked directly, so a JAX upgrade that breaks one fails here
loudly (and names it) instead of somewhere deep in a tapped program."""
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap
from jaxtap import _seam
from jaxtap._seam import stack as _stack
from taputil import assert_bits  # noqa: E402


def test_primitive_names_we_rewrite():
    assert (_seam.SCAN, _seam.WHILE, _seam.COND, _seam.JIT) == ("scan", "while", "cond", "jit")
    assert _seam.REMAT == "remat2"
    assert (_seam.CUSTOM_JVP, _seam.CUSTOM_VJP) == ("custom_jvp_call", "custom_vjp_call")
    # what an events-only run leaves out (the user's debug effects: _rules.observed)
    assert {"debug_callback", "debug_print"} <= _seam.DEBUG_EFFECTS


def test_equation_params_we_read():
    def f(x):
        c, _ = jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=2)
        _, w = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1]), (0, c))
        return jax.jit(jnp.sin)(jax.lax.cond(w > 0, lambda v: v, lambda v: -v, w))

    eqns = {e.primitive.name: e for e in jax.make_jaxpr(f)(1.0).jaxpr.eqns}
    body, nc, ncar, length = _seam.scan_parts(eqns["scan"].params)
    assert (nc, ncar, length) == (0, 1, 2) and isinstance(body, _seam.ClosedJaxpr)
    assert "reverse" in eqns["scan"].params
    cond, cnc, wbody, bnc = _seam.while_parts(eqns["while"].params)
    assert isinstance(cond, _seam.ClosedJaxpr) and isinstance(wbody, _seam.ClosedJaxpr)
    assert len(_seam.cond_branches(eqns["cond"].params)) == 2
    jp = eqns["jit"].params
    for key in ("jaxpr", "in_shardings", "in_layouts", "donated_invars", "name", "keep_unused", "inline"):
        assert key in jp, key


def test_the_jit_key_config_state_separates_compilations():
    token = object()
    assert _seam.token_state_in_trace_context(token), "JAX no longer puts our config state in the jit key"
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return x + 1

    f(1.0)
    _seam.set_thread_token(token)
    try:
        f(1.0)
    finally:
        _seam.set_thread_token(None)
    f(1.0)
    assert len(traces) == 2  # clean, tokened, clean again (cache hit)


def test_bind_interception_is_an_instance_attribute():
    prim = _seam.scan_p
    assert not _seam.bind_is_patched(prim)
    seen = []

    def spy(*args, **params):
        seen.append(1)
        return _seam.bind_original(prim, args, params)

    _seam.install_bind(prim, spy)
    try:
        jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=1))(0.0)
    finally:
        _seam.uninstall_bind(prim)
    assert seen == [1] and not _seam.bind_is_patched(prim)


def test_loop_body_traces_are_recognized():
    # the inner scan is bound while JAX traces the outer body: the with-form
    # must leave it to the outer loop's walk (else it would be tapped twice)
    def f(x):
        def body(c, _):
            return jax.lax.scan(lambda cc, _: (cc + 1.0, None), c, None, length=2)[0], None
        return jax.lax.scan(body, x, None, length=3)[0]

    with tap.record(select=lambda _: ()) as rec:
        jax.block_until_ready(jax.jit(f)(1.0))
    paths = [e.path for e in rec.events]
    assert paths.count("scan[0]") == 3 and paths.count("scan[0]/scan[0]") == 6 and len(paths) == 9


def test_user_sites_skip_jax_and_jaxtap_frames():
    def f(x):
        return jax.lax.scan(lambda c, _: (c, None), x, None, length=1)

    eqn = jax.make_jaxpr(f)(1.0).jaxpr.eqns[0]
    site = _seam.site_of_eqn(eqn)
    assert site[0] == __file__ and isinstance(site[1], int)


def test_original_scan_is_the_public_one():
    assert tap.original_scan is jax.lax.scan
    assert tap.original_while_loop is jax.lax.while_loop


def test_the_functions_that_bind_user_loops():
    """The with-form taps a loop only when JAX's user-facing loop function
    (or the scan transpose, for backward loops) binds it; anything else in
    loops.py re-binds an existing loop. Those names must exist."""
    from jax._src.lax.control_flow import loops

    for name in _stack._USER_BINDERS - {"_scan_transpose"}:  # (the pre-"fancy" transpose name)
        assert callable(getattr(loops, name, None)), f"jax's loops.py no longer defines {name}"
    assert loops.__file__.endswith(_stack._LOOPS_FILE)


def test_autodiff_tangent_traces_are_recognised():
    """Derivative code is staged into traces that auto-DCE; jax-tap never taps there."""
    seen = []

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        seen.append(_stack.in_derivative_code())
        return jnp.sin(primals[0]), tangents[0] * jnp.cos(primals[0])

    jax.grad(f)(1.0)
    assert seen and any(seen)
    assert not _stack.in_derivative_code()


# ---------------------------------------------------------------- per-version vocabulary
def test_every_internal_the_seam_imports_exists():
    assert not _seam.MISSING, f"this JAX lacks internals jax-tap imports: {_seam.MISSING}"


def test_this_jax_is_in_the_tested_range_and_pyproject_declares_it():
    import pathlib
    import re

    assert _seam.tested(), f"JAX {jax.__version__} is outside {_seam.TESTED_RANGE}"
    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    if pyproject.exists():  # (a source checkout)
        spec = re.search(r'"jax(>=[^"]+)"', pyproject.read_text()).group(1)
        assert spec == ">=0.10.2,<0.13", f"pyproject's JAX range {spec!r} is not the tested {_seam.TESTED_RANGE}"
    assert _seam.versions.parse("0.12.0.1") == (0, 12, 0, 1) and _seam.versions.parse("0.13.0rc1") == (0, 13, 0)
    assert not _seam.tested((0, 10, 1)) and _seam.tested((0, 12, 7)) and not _seam.tested((0, 13, 0))


def test_scan_params_speak_consts_carry_xs_on_every_jax():
    """JAX <= 0.10: num_consts/num_carry/linear; JAX >= 0.11: ft_in/ft_out flat trees."""
    w = jnp.float32(2.0)

    def f(c0, xs):
        return jax.lax.scan(lambda c, x: (c * w + x, c), c0, xs)

    eqn = next(e for e in jax.make_jaxpr(f)(jnp.float32(1.0), jnp.ones(3)).jaxpr.eqns if e.primitive is _seam.scan_p)
    body, nc, ncar, length = _seam.scan_parts(eqn.params)
    assert (nc, ncar, length) == (1, 1, 3), "scan's consts/carry split"
    assert len(body.in_avals) == nc + ncar + 1, "scan body = consts + carry + xs"

    # the counter rewrite: one more trailing const, one more leading carry
    def counted(*a):
        consts, extra, i, c, x = a[:nc], a[nc], a[nc + 1], a[nc + 2], a[nc + 3]
        outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, *consts, c, x)
        return [i + extra] + list(outs)

    avals = list(body.in_avals)
    new_body = _seam.trace_closed(counted, avals[:nc] + [_seam.abstractify(np.int32(0))] * 2 + avals[nc:])
    params = _seam.scan_with_counter(eqn.params, new_body, extra_consts=1)
    outs = _seam.bind_original(_seam.scan_p, [w, np.int32(1), np.int32(0), jnp.float32(1.0), jnp.ones(3)], params)
    assert int(outs[0]) == 3, "scan_with_counter: the counter is the first carry"
    assert_bits(list(outs[1:]), list(f(jnp.float32(1.0), jnp.ones(3))), "scan_with_counter: the user's outputs")


def test_call_closed_stages_the_call_primitive_scan_lowers_with():
    """JAX <= 0.10: eval_jaxpr_p(jaxpr=); JAX >= 0.11: eval_jaxpr_p is closed_call_p(call_jaxpr=)."""
    closed = _seam.trace_closed(lambda x: [jnp.sin(x) * 2.0], [_seam.abstractify(jnp.float32(0))])
    out = jax.jit(lambda x: _seam.call_closed(closed, [x])[0])(jnp.float32(0.5))
    assert np.asarray(out).tobytes() == np.asarray(jnp.sin(jnp.float32(0.5)) * 2.0).tobytes()


def test_a_vmapped_tapped_scan_passes_jax_enable_checks():
    """JAX's own checker (``jax_enable_checks``, on in JAX's test suites) must
    accept a tapped program: on JAX 0.10 vmap restaged the runner's call as a
    closed_call the checker rejected (TypeError: unexpected keyword 'name');
    the compiled program is the same with checks on and off."""
    def loss(w, xs):
        def step(s, x):
            s = jnp.tanh(w @ jnp.concatenate([s, x]))
            return s, s.sum()
        return jnp.sum(jax.lax.scan(step, jnp.zeros(2), xs)[1] ** 2)
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
    xs = np.linspace(0, 1, 84, dtype=np.float32).reshape(7, 3, 4)
    f = jax.vmap(lambda x: jax.jit(loss)(w, x))
    plain = f(xs)
    with jax.enable_checks(True):
        with tap.record() as rec:
            out = f(xs)
    assert_bits(out, plain)
    assert len(rec) == 3 * 7  # 3 steps, 7 lanes
    texts = []
    for checks in (False, True):
        with jax.enable_checks(checks), tap.record():
            texts.append(jax.jit(loss).lower(w, xs[0]).compile().as_text())
    strip = lambda t: re.sub(r", metadata=\{[^}]*\}", "", t)  # noqa: E731
    assert strip(texts[0]) == strip(texts[1])


def test_remat_and_call_bodies_open_and_close():
    """JAX >= 0.11 has one jaxpr type (ClosedJaxpr is Jaxpr); remat keeps an open body."""
    eqn = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x) * x))(1.0).jaxpr.eqns[0]
    assert eqn.primitive is _seam.remat_p
    body = _seam.remat_body(eqn.params)
    assert isinstance(body, _seam.ClosedJaxpr) and len(body.in_avals) == 1, "remat_body"
    params, consts = _seam.remat_with_body(eqn.params, body)
    assert consts == [] and _seam.bind_original(_seam.remat_p, [jnp.float32(1.0)], params) is not None


def test_scan_buffers_and_indexing_helpers():
    aval = _seam.abstractify(jnp.zeros((2,), jnp.float32))
    out = jax.jit(lambda: _seam.update_index_in_dim(_seam.empty_stack(3, aval), jnp.ones(2), np.int32(1)))()
    assert out.shape == (3, 2) and np.asarray(_seam.index_in_dim(out, np.int32(1))).tolist() == [1.0, 1.0]
    assert jax.jit(lambda: _seam.empty_like(aval))().shape == (2,)


def test_hijax_primitives_expand_to_their_loops():
    """JAX >= 0.12 stages some library operations (searchsorted, einsum,
    custom_root, ...) as call_hi_primitive, whose loops exist only in its
    expansion; the walker reads them there."""
    if _seam.HI_CALL is None:
        return  # (a JAX without hijax primitives has nothing to expand)
    f = lambda a, v: jnp.searchsorted(a, v, method="scan")  # noqa: E731
    closed = jax.make_jaxpr(f)(jnp.arange(8.0), jnp.float32(2.5))
    names = _seam.collect_names(closed.jaxpr)
    if _seam.HI_CALL in names:
        assert _seam.SCAN in names, "the hijax primitive's expansion holds its scan"
    seen = []
    tap.verbose(f, on_step=seen.append)(jnp.arange(8.0), jnp.float32(2.5))
    jax.effects_barrier()
    assert seen and all(e.path == "scan[0]" for e in seen)


def test_differentiating_sees_autodiff_traces():
    seen = []

    def f(x):
        seen.append(_seam.differentiating())
        return x * 2.0

    f(1.0)
    jax.grad(f)(1.0)
    jax.jvp(f, (1.0,), (1.0,))
    jax.jit(f)(1.0)
    assert seen == [False, True, True, False], seen
    with _seam.differentiated(True):
        assert _seam.differentiating()


def test_an_untested_jax_warns_once_at_import_and_still_runs():
    from taputil import run_python

    r = run_python("""
        import warnings, jax, jax.numpy as jnp
        jax.__version__ = "0.99.0"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import jaxtap as tap
        msgs = [str(x.message) for x in w if "jax-tap" in str(x.message)]
        assert len(msgs) == 1 and "0.10.2 to 0.12.x" in msgs[0] and "0.99.0" in msgs[0], msgs
        with tap.record() as rec:
            out = jax.lax.scan(lambda c, _: (c + 1.0, None), jnp.float32(0), None, length=3)[0]
        assert float(out) == 3.0
        print("OK", len(rec.events))
    """)
    assert r.returncode == 0 and "OK 3" in r.stdout, r.stdout + r.stderr


def test_a_jax_without_our_internals_runs_the_program_untapped():
    """Never a crash: a JAX that moved an internal the with-form needs gets
    one warning naming it (at the first block, where jax-tap registers its
    jit-key state), and blocks run the user's code untapped."""
    from taputil import run_python

    r = run_python("""
        import warnings, jax, jax.numpy as jnp
        from jax._src import config
        def gone(*a, **k):
            raise AttributeError("string_or_object_state")
        config.string_or_object_state = gone
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import jaxtap as tap
            with tap.record() as rec:
                out = jax.lax.scan(lambda c, _: (c + 1.0, None), jnp.float32(0), None, length=3)[0]
        msgs = [str(x.message) for x in w if "jax-tap" in str(x.message)]
        assert float(out) == 3.0 and len(rec.events) == 0
        assert any("string_or_object_state" in m for m in msgs) and any("untapped" in m for m in msgs), msgs
        print("OK")
    """, "-W", "error")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_trace_names_and_files_the_heuristics_match_exist_in_this_jax():
    """The stack heuristics recognize JAX's loop-body traces, linear-solve
    traces and plumbing files by name: each must still be JAX's."""
    import pathlib

    root = pathlib.Path(jax.__file__).parent
    sources = {
        "loops": (root / "_src" / "lax" / "control_flow" / "loops.py").read_text(),
        "solves": (root / "_src" / "lax" / "control_flow" / "solves.py").read_text(),
        "mlir": (root / "_src" / "interpreters" / "mlir.py").read_text(),
    }
    where = {"scan": "loops", "while_body": "loops", "while_cond": "loops", "fori_loop": "loops",
             "lower_fun": "mlir", "custom_linear_solve": "solves", "custom_linear_solve solve": "solves",
             "custom_linear_solve transpose_solve": "solves", "custom_root tangent_solve": "solves"}
    # JAX >= 0.11 made lax.custom_root a hijax primitive: no trace of that name
    gone_since = {"custom_root tangent_solve": (0, 11)}
    for name in _stack._LOOP_BODY_TRACES | _stack._LINEAR_TRACES:
        if _seam.JAX_VERSION[:2] >= gone_since.get(name, (99,)):
            continue
        text = sources[where[name]]
        quoted = f'"{name}"' in text or f"'{name}'" in text or name.split(" ")[-1] in text
        assert quoted, f"JAX no longer traces anything for {name!r} (stack heuristics)"
    for part in _stack._PLUMBING + _stack._BINDER_FILES:
        rel = part.split(os.path.join("jax", ""), 1)[1]
        assert (root / rel).exists(), f"JAX plumbing {part!r} the site heuristics skip is gone"


def test_the_wrapping_form_runs_untapped_when_the_rewrite_fails(monkeypatch):
    """A JAX change the seam missed must not crash verbose(f): one warning,
    the user's program untapped."""
    import warnings

    from jaxtap import _loops

    def broken(*a, **k):
        raise KeyError("num_consts")  # (what JAX 0.11 did to an unprepared seam)

    monkeypatch.setattr(_loops._seam, "scan_parts", broken)
    f = lambda x: jax.lax.scan(lambda c, _: (c * 1.5, None), x, None, length=3)[0]  # noqa: E731
    seen = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = tap.verbose(f, on_step=seen.append)(jnp.float32(1.0))
    assert float(out) == 3.375 and seen == []
    assert any("untapped" in str(x.message) and "num_consts" in str(x.message) for x in w)


def test_both_forms_run_untapped_on_a_jax_without_the_jit_key_state(monkeypatch):
    """A JAX lacking the config state interception keys jits with: blocks and
    wrapped calls run the user's code as it is, with one warning."""
    import warnings

    from jaxtap._seam import keys

    monkeypatch.setattr(keys, "can_intercept", lambda: False)
    monkeypatch.setattr(keys, "warn_once_now", lambda msg: said.append(msg))
    said = []
    f = lambda x: jax.lax.scan(lambda c, _: (c * 1.5, None), x, None, length=3)[0]  # noqa: E731
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing else may warn
        out_v = tap.verbose(f, on_step=seen.append)(jnp.float32(1.0))
        with tap.record() as rec:
            out_w = f(jnp.float32(1.0))
    jax.effects_barrier()
    assert float(out_v) == float(out_w) == 3.375 and seen == [] and len(rec) == 0
    assert len(said) == 2 and all("lacks the jit-key state" in m and "untapped" in m for m in said)
    assert "f runs untapped" in said[0] and "the block runs untapped" in said[1]


def test_compile_time_signals_the_monitor_reads():
    """What jit-event and trace-time taps read: the top-level jit call, the
    compile entry point, the span names (``f``; ``jit(f)``), the cache
    events and the weak-type promotion of loop carries."""
    import inspect

    from jax._src import compiler, dispatch, monitoring, pjit
    from jax._src.lax.control_flow import loops

    assert list(inspect.signature(pjit._infer_params).parameters)[:4] == ["fun", "ji", "args", "kwargs"]
    assert callable(compiler.compile_or_get_cached)
    for name in ("JAXPR_TRACE_EVENT", "JAXPR_TO_MLIR_MODULE_EVENT", "BACKEND_COMPILE_EVENT"):
        assert getattr(dispatch, name) in (_seam.monitor.TRACE_SPAN, _seam.monitor.LOWER_SPAN,
                                           _seam.monitor.COMPILE_SPAN)
    assert isinstance(monitoring._event_time_span_listeners, list) and isinstance(monitoring._event_listeners, list)
    assert list(inspect.signature(loops._promote_weak_typed_input).parameters) == ["in_val", "in_aval", "out_aval"]
    seen = []

    def span(event, start, end, **kw):
        seen.append((event, kw.get("fun_name")))

    monitoring.register_event_time_span_listener(span)
    try:
        def seam_probe(x):
            return x * 3.0

        jax.jit(seam_probe)(jnp.ones(3))
    finally:
        monitoring._event_time_span_listeners.remove(span)
    assert (_seam.monitor.TRACE_SPAN, "seam_probe") in seen
    assert (_seam.monitor.COMPILE_SPAN, "jit(seam_probe)") in seen


def test_scan_autodiff_rules_cotangent_taps_wrap():
    """Cotangent taps wrap scan's linearize / JVP / transpose rules: they
    exist, are wrapped only while a scope asks, and a transposed scan is
    mapped to its forward twin (which carry leaves have a tangent; how many
    leading backward carry leaves are the closed-over values' accumulators)."""
    from jax._src.interpreters import ad

    import jaxtap as tap

    scan_p = _seam.scan_p
    before = (ad.primitive_linearizations[scan_p], ad.primitive_jvps[scan_p], ad.fancy_transposes[scan_p])

    def f(w):
        def body(c, _):
            n, x = c
            return (n + 1, jnp.sin(w * x)), None
        return jax.lax.scan(body, (0, jnp.float32(0.5)), None, length=3)[0][1]

    registry = _seam.backward._by_jaxpr
    registry.clear()
    with tap.record(backward=True):
        assert _seam.backward_rules_installed()
        jax.make_jaxpr(jax.grad(f))(jnp.float32(0.7))
    infos = list(registry.values())
    assert len(infos) == 1, infos
    info = infos[0]
    assert info.carry_nz == (False, True) and info.n_params == 1
    assert [str(a.dtype) for a in info.carry_avals] == ["int32", "float32"]
    assert not _seam.backward_rules_installed()
    assert (ad.primitive_linearizations[scan_p], ad.primitive_jvps[scan_p], ad.fancy_transposes[scan_p]) == before


# ------------------------------------------------------------------ the host callback


def _cb_program(stage):
    def f(x):
        def body(c, _):
            c = jnp.sin(c) * 0.5 + c
            stage(c)
            return c, None
        return jax.lax.scan(body, x, None, length=5)[0]
    return f


def test_the_host_callback_is_the_fast_primitive_and_hands_over_numpy():
    assert _seam.FAST_HOST_CALLBACK, "this JAX lost an internal the fast host callback needs"
    seen = []
    out = jax.jit(_cb_program(lambda c: _seam.host_callback(lambda a: seen.append(a), c)))(jnp.ones(3))
    jax.effects_barrier()
    assert len(seen) == 5 and all(type(a) is np.ndarray for a in seen)
    assert_bits(out, jax.jit(_cb_program(lambda c: None))(jnp.ones(3)))
    assert np.array_equal(seen[-1], np.asarray(out))


def _optimized_hlo(f, x):
    import re
    text = jax.jit(f).lower(x).compile().as_text()
    # the callback's descriptor (a host pointer), its name and source locations may differ
    text = re.sub(r"backend_config=\S+|custom_call_target=\"[^\"]*\"|, metadata=\{[^}]*\}", "", text)
    text = text.replace("jaxtap_callback", "debug_callback")
    return [ln.strip() for ln in text.splitlines() if ln.lstrip().startswith(("%", "ROOT"))]


def test_the_host_callback_compiles_exactly_as_jax_debug_callback():
    ours = _optimized_hlo(_cb_program(lambda c: _seam.host_callback(lambda a: None, c)), jnp.ones(3))
    theirs = _optimized_hlo(_cb_program(lambda c: jax.debug.callback(lambda a: None, c)), jnp.ones(3))
    assert sum(" custom-call(" in ln for ln in ours) == sum(" custom-call(" in ln for ln in theirs) == 1
    assert ours == theirs


def test_the_host_callback_under_vmap_grad_jvp_and_checkpoint():
    calls = []

    def f(x):
        def body(c, _):
            _seam.host_callback(lambda a: calls.append(a.shape), c)
            return jnp.sin(c) * c, None
        return jax.lax.scan(jax.checkpoint(body), x, None, length=3)[0].sum()

    def plain(x):  # (with JAX's own callback: XLA compiles a loop that holds one otherwise)
        def body(c, _):
            jax.debug.callback(lambda a: None, c)
            return jnp.sin(c) * c, None
        return jax.lax.scan(jax.checkpoint(body), x, None, length=3)[0].sum()

    x = jnp.linspace(0.1, 0.9, 4)
    assert_bits(jax.jit(jax.grad(f))(x), jax.jit(jax.grad(plain))(x))
    assert_bits(jax.jit(jax.vmap(f))(x[:, None]), jax.jit(jax.vmap(plain))(x[:, None]))
    assert_bits(jax.jvp(f, (x,), (x,)), jax.jvp(plain, (x,), (x,)))
    jax.effects_barrier()
    # vmap (unbatched by the primitive's rule): one call per lane, each with one lane's value
    assert calls.count((1,)) == 12 and calls.count((4,)) >= 6


def test_a_raising_host_callback_warns_and_the_program_goes_on(recwarn):
    def boom(a):
        raise RuntimeError("consumer failed")

    out = jax.jit(_cb_program(lambda c: _seam.host_callback(boom, c)))(jnp.ones(3))
    jax.effects_barrier()
    assert_bits(out, jax.jit(_cb_program(lambda c: None))(jnp.ones(3)))
    assert any("consumer failed" in str(w.message) for w in recwarn)


def test_the_loop_front_ends_name_what_they_move_out_of_the_carry():
    """lax.scan / lax.while_loop keep ``move_to_const`` (and scan
    ``ext_to_ext_fwd``) as locals when they bind: _seam.forwarding reads them."""
    def f(p, x):
        s = jax.lax.scan(lambda c, x: ((c[0], c[1] * c[0] + x), x), (p, x), jnp.arange(2.0))
        w = jax.lax.while_loop(lambda s: s[1] < 9.0, lambda s: (s[0], s[1] + s[0]), (p, x))
        return s, w

    with tap.record(where=lambda path: False):  # a block active: binds are noted, nothing emits
        jaxpr = jax.make_jaxpr(f)(1.0, 2.0)
    loops = {e.primitive: e.params for e in jaxpr.eqns if e.primitive in (_seam.scan_p, _seam.while_p)}
    scan_fwd = _seam.forwarding_of(_seam.scan_p, loops[_seam.scan_p])
    while_fwd = _seam.forwarding_of(_seam.while_p, loops[_seam.while_p])
    assert scan_fwd == _seam.Forwarded(carry=(True, False), ys=(0,))
    assert while_fwd == _seam.Forwarded(carry=(True, False), ys=())


def test_a_hop_keeps_its_threads_python_state_between_calls():
    """XLA:CPU calls back on threads of its own pool in a nest of loops (NUTS
    here); each keeps its Python state and thread-locals from one hop to the
    next instead of creating and deleting it on every hop."""
    blackjax = pytest.importorskip("blackjax")

    def logdensity(p):
        x, s = p["x"], p["log_s"]
        return -0.5 * jnp.sum((x - 1.0) ** 2 / jnp.exp(2 * s)) - jnp.sum(s) - 0.5 * jnp.sum(s ** 2)

    kernel = blackjax.nuts(logdensity, step_size=0.5, inverse_mass_matrix=jnp.ones(10)).step
    state = blackjax.nuts.init({"x": jnp.zeros(5), "log_s": jnp.zeros(5)}, logdensity)
    f = jax.jit(lambda s, ks: jax.lax.scan(lambda st, k: (kernel(k, st)[0], None), s, ks))
    local, seen = threading.local(), []

    def probe(event):
        seen.append((threading.get_ident(), getattr(local, "mark", False)))
        local.mark = True

    with tap.record(select=lambda _: (), on_step=probe):
        jax.block_until_ready(f(state, jax.random.split(jax.random.key(0), 300)))
    jax.effects_barrier()
    fresh = [ident for ident, marked in seen if not marked]
    assert len(seen) > 1000 and len(fresh) == len(set(fresh))  # a thread's first hop only


def test_a_hop_on_an_accelerator_without_a_cpu_backend_still_delivers(monkeypatch):
    """JAX_PLATFORMS=cuda leaves JAX without a CPU device (found on an H100,
    2026-12-05: every hop was dropped with a warning). A hop compiled for an
    accelerator puts its consumer's JAX work on the CPU where there is one;
    where there is none the consumer runs as it is."""
    from jaxtap._seam import callback

    def no_cpu(backend=None):
        raise RuntimeError(f"Unknown backend {backend}")

    monkeypatch.setattr(callback, "_CPU", [])
    monkeypatch.setattr(jax, "local_devices", no_cpu)
    seen = []
    callback._call(lambda a: seen.append(int(a.sum())), [np.arange(4)], True)
    assert seen == [6]
    monkeypatch.undo()
    callback._call(lambda a: seen.append(jnp.zeros(()).devices()), [np.arange(4)], True)
    assert seen[1] == {jax.local_devices(backend="cpu")[0]}
