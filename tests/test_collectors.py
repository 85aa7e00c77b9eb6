"""Collectors: tap.FlightRecorder (+ .df()), tap.JSONLWriter, tap.read_jsonl.

Spec: README "Quick start", "Design principles" (callback totality,
emission only) and the collectors' docstrings.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap
from taputil import assert_bits as assert_bitwise


# --------------------------------------------------------------------- helpers
def run(g, *args):
    out = jax.block_until_ready(g(*args))
    jax.effects_barrier()
    return out




def counter_scan(x0):
    """carry after step k: x0 * 1.5**(k+1) + ...; 5 steps, per-step ys."""
    return jax.lax.scan(lambda c, _: (c * 1.5 + 0.25, c), x0, None, length=5)


def pair_scan(init):
    """A two-leaf carry (float32, int32)."""

    def body(c, _):
        return (c[0] * 1.5 + 0.25, c[1] + 1), None

    return jax.lax.scan(body, init, None, length=4)


PAIR0 = (jnp.float32(1.0), jnp.int32(0))
PAIR_FLOATS = [1.75, 2.875, 4.5625, 7.09375]  # exact in float32


def nested_scan(x0):
    def outer(c, _):
        d, _ = jax.lax.scan(lambda d, _: (d + 1.0, None), c, None, length=2)
        return d * 2.0, None

    return jax.lax.scan(outer, x0, None, length=3)


def tap_warnings(w):
    return [x for x in w if issubclass(x.category, tap.TapWarning)]


# ============================================================ FlightRecorder
def test_recorder_callable_as_on_step_keeps_arrival_order():
    rec = tap.FlightRecorder()
    g = tap.verbose(counter_scan, on_step=rec, select=lambda leaves: leaves[0])
    run(g, jnp.float32(1.0))
    evs = rec.events
    assert [(e.path, e.step, e.total, e.kind) for e in evs] == [("scan[0]", i, 5, "carry") for i in range(5)]
    expected, c = [], np.float32(1.0)
    for _ in range(5):
        c = np.float32(c * np.float32(1.5) + np.float32(0.25))
        expected.append(c)
    assert [e.value for e in evs] == expected
    assert len(rec) == 5 and list(rec) == evs


def test_recorder_arrival_order_for_nested_loops():
    rec = tap.FlightRecorder()
    g = tap.verbose(nested_scan, on_step=rec, select=lambda leaves: leaves[0])
    run(g, jnp.float32(0.0))
    # inner steps of each outer iteration arrive before that outer step
    assert [(e.path, e.step) for e in rec.events] == [
        ("scan[0]/scan[0]", 0), ("scan[0]/scan[0]", 1), ("scan[0]", 0),
        ("scan[0]/scan[0]", 0), ("scan[0]/scan[0]", 1), ("scan[0]", 1),
        ("scan[0]/scan[0]", 0), ("scan[0]/scan[0]", 1), ("scan[0]", 2),
    ]
    assert [float(e.value) for e in rec.events if e.path == "scan[0]"] == [4.0, 12.0, 28.0]


@pytest.mark.parametrize("outer", ["scan", "while"])
@pytest.mark.parametrize("sample_every", [1, 2])
def test_nested_order_holds_when_only_the_step_crosses(outer, sample_every):
    """A hop that ships only its step still runs after the taps inside its
    step (its step comes out of the runner, which orders the callbacks)."""
    def inner(c):
        return jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] * 2.0), (0, c))[1]

    def f(c):
        if outer == "scan":
            return jax.lax.scan(lambda c, x: (inner(c) + x, None), c, jnp.arange(4.0))[0]
        return jax.lax.while_loop(lambda s: s[0] < 4, lambda s: (s[0] + 1, inner(s[1])), (0, c))[1]

    with tap.record(select=lambda _: (), sample_every=sample_every) as rec:
        jax.block_until_ready(f(jnp.float32(1.0)))
    top = f"{outer}[0]"
    inner_steps = [0] if sample_every == 2 else [0, 1]
    expected = []
    for step in range(4):
        expected += [(f"{top}/while[0]", k) for k in inner_steps]  # the inner loop restarts each outer step
        if step % sample_every == 0:
            expected.append((top, step))
    assert [(e.path, int(e.step)) for e in rec.events] == expected


def test_recorder_direct_append_and_clear():
    rec = tap.FlightRecorder()
    evs = [tap.TapEvent("scan[0]", i, float(i), 3) for i in range(3)]
    for e in evs:
        rec(e)
    assert rec.events == evs
    rec.clear()
    assert rec.events == [] and len(rec) == 0


def test_recorder_maxlen_keeps_last_n():
    rec = tap.FlightRecorder(maxlen=3)
    for i in range(10):
        rec(tap.TapEvent("a", i, np.float32(i)))
    assert [e.step for e in rec.events] == [7, 8, 9]
    assert isinstance(rec.events, list) and len(rec) == 3


def test_recorder_maxlen_with_real_program():
    rec = tap.FlightRecorder(maxlen=2)
    g = tap.verbose(counter_scan, on_step=rec, select=lambda leaves: leaves[0])
    run(g, jnp.float32(1.0))
    assert [e.step for e in rec.events] == [3, 4]


def test_record_maxlen_keyword():
    with tap.record(select=lambda leaves: leaves[0], maxlen=2) as rec:
        counter_scan(jnp.float32(1.0))
    assert [e.step for e in rec.events] == [3, 4]


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_recorder_rejects_bad_maxlen(bad):
    with pytest.raises(ValueError, match="maxlen"):
        tap.FlightRecorder(maxlen=bad)


def test_events_snapshot_not_affected_by_later_appends():
    rec = tap.FlightRecorder(maxlen=5)
    rec(tap.TapEvent("a", 0, 1.0))
    snap = rec.events
    rec(tap.TapEvent("a", 1, 2.0))
    assert len(snap) == 1 and len(rec.events) == 2


# ======================================================================== df
@pytest.fixture
def pd():
    return pytest.importorskip("pandas")


def test_df_scalar_value_column(pd):
    with tap.record(select=lambda leaves: leaves[0]) as rec:
        pair_scan(PAIR0)
    df = rec.df()
    assert list(df.columns) == ["path", "step", "value"]
    assert len(df) == 4
    assert df["step"].tolist() == [0, 1, 2, 3]
    assert (df["path"] == "scan[0]").all()
    assert df["value"].tolist() == PAIR_FLOATS
    assert pd.api.types.is_numeric_dtype(df["value"]) and pd.api.types.is_integer_dtype(df["step"])


def test_df_tuple_value_columns(pd):
    with tap.record() as rec:  # select=None: the full leaf tuple
        pair_scan(PAIR0)
    df = rec.df()
    assert list(df.columns) == ["path", "step", "value_0", "value_1"]
    assert df["value_0"].tolist() == PAIR_FLOATS
    assert df["value_1"].tolist() == [1, 2, 3, 4]
    assert pd.api.types.is_float_dtype(df["value_0"])
    assert pd.api.types.is_integer_dtype(df["value_1"])


def test_df_list_value_columns(pd):
    rec = tap.FlightRecorder()
    rec(tap.TapEvent("p", 0, [np.float32(1.0), np.int32(2)]))
    rec(tap.TapEvent("p", 1, [np.float32(3.0), np.int32(4)]))
    df = rec.df()
    assert list(df.columns) == ["path", "step", "value_0", "value_1"]
    assert df["value_0"].tolist() == [1.0, 3.0] and df["value_1"].tolist() == [2, 4]


def test_df_dict_value_one_column_per_key(pd):
    with tap.record(select=lambda leaves: {"pos": leaves[0], "n": leaves[1], "big": leaves[0] > 3.0}) as rec:
        pair_scan(PAIR0)
    df = rec.df()
    assert list(df.columns[:2]) == ["path", "step"]
    assert set(df.columns[2:]) == {"pos", "n", "big"}
    assert df["pos"].tolist() == PAIR_FLOATS
    assert df["n"].tolist() == [1, 2, 3, 4]
    assert df["big"].tolist() == [False, False, True, True]
    assert pd.api.types.is_float_dtype(df["pos"]) and pd.api.types.is_integer_dtype(df["n"])
    assert pd.api.types.is_bool_dtype(df["big"])


def test_df_kind_and_total_columns(pd):
    with tap.record(select=lambda leaves: leaves[0]) as rec:
        pair_scan(PAIR0)
    df = rec.df(kind=True, total=True)
    assert set(df.columns) == {"path", "step", "kind", "total", "value"}
    assert df["kind"].tolist() == ["carry"] * 4
    assert df["total"].tolist() == [4] * 4
    assert "kind" not in rec.df().columns and "total" not in rec.df().columns
    assert set(rec.df(kind=True).columns) == {"path", "step", "kind", "value"}


def test_df_kind_distinguishes_primitive_events(pd):
    with tap.record(select=lambda leaves: leaves[0], taps=[tap.on("mul")]) as rec:
        counter_scan(jnp.float32(1.0))
    df = rec.df(kind=True)
    assert sorted(set(df["kind"])) == ["carry", "primitive"]
    assert set(df.loc[df["kind"] == "primitive", "path"]) == {"scan[0]/mul[0]"}
    assert (df["kind"] == "primitive").sum() == 5


def test_df_groupby_and_plot_friendly(pd):
    with tap.record(select=lambda leaves: leaves[0]) as rec:
        nested_scan(jnp.float32(0.0))
    df = rec.df()
    sizes = df.groupby("path").size().to_dict()
    assert sizes == {"scan[0]": 3, "scan[0]/scan[0]": 6}
    means = df.groupby("path")["value"].mean()
    assert means["scan[0]"] == pytest.approx((4.0 + 12.0 + 28.0) / 3)
    # pivot to a step-indexed frame per path: numeric, ready for .plot()
    wide = df[df["path"] == "scan[0]"].set_index("step")["value"]
    assert pd.api.types.is_numeric_dtype(wide) and wide.index.tolist() == [0, 1, 2]
    assert np.asarray(wide.to_numpy(), dtype=float).tolist() == [4.0, 12.0, 28.0]


def test_df_empty_recorder_has_base_columns(pd):
    rec = tap.FlightRecorder()
    assert list(rec.df().columns) == ["path", "step"]
    assert list(rec.df(kind=True, total=True).columns) == ["path", "step", "kind", "total"]
    assert len(rec.df()) == 0


def test_df_empty_payload_has_only_path_step(pd):
    with tap.record(select=lambda _: ()) as rec:
        counter_scan(jnp.float32(1.0))
    df = rec.df()
    assert list(df.columns) == ["path", "step"] and df["step"].tolist() == list(range(5))


def test_df_without_pandas_names_the_extra(monkeypatch):
    rec = tap.FlightRecorder()
    rec(tap.TapEvent("a", 0, 1.0))
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r'pip install "jax-tap\[pandas\]"'):
        rec.df()


# ======================================================================= JSONL
def test_jsonl_writer_as_on_step_one_object_per_line(tmp_path):
    path = tmp_path / "run.jsonl"
    w = tap.JSONLWriter(str(path))
    g = tap.verbose(counter_scan, on_step=w, select=lambda leaves: leaves[0])
    run(g, jnp.float32(1.0))
    # still open: everything is already on disk (flushed per event)
    lines = path.read_text().splitlines()
    assert len(lines) == 5
    objs = [json.loads(line) for line in lines]
    assert all(isinstance(o, dict) for o in objs)
    assert [(o["path"], o["step"], o["total"], o["kind"]) for o in objs] == [("scan[0]", i, 5, "carry") for i in range(5)]
    w.close()


def test_jsonl_flushes_every_event_while_running(tmp_path):
    path = tmp_path / "live.jsonl"
    w = tap.JSONLWriter(str(path))
    counts = []

    def consumer(e):
        w(e)
        with open(path, encoding="utf-8") as fh:  # read while the writer is open
            counts.append(sum(1 for line in fh if line.strip()))

    g = tap.verbose(counter_scan, on_step=consumer, select=lambda leaves: leaves[0])
    run(g, jnp.float32(1.0))
    w.close()
    assert counts == [1, 2, 3, 4, 5]


def test_jsonl_context_manager_closes(tmp_path):
    path = tmp_path / "cm.jsonl"
    with tap.JSONLWriter(str(path)) as w:
        assert isinstance(w, tap.JSONLWriter)
        w(tap.TapEvent("scan[0]", 0, np.float32(1.0), 2))
    # after close, further events are dropped, said once (helper-44: silently before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w(tap.TapEvent("scan[0]", 1, np.float32(2.0), 2))
        w(tap.TapEvent("scan[0]", 2, np.float32(3.0), 2))
        w.close()  # idempotent
    said = tap_warnings(caught)
    assert len(said) == 1 and "after close()" in str(said[0].message) and "make a new JSONLWriter" in str(said[0].message)
    assert len(path.read_text().splitlines()) == 1


def test_jsonl_with_form_on_step_roundtrip(tmp_path):
    path = tmp_path / "with.jsonl"
    with tap.JSONLWriter(str(path)) as w:
        with tap.record(on_step=w, select=lambda leaves: {"x": leaves[0], "n": leaves[1]}) as rec:
            pair_scan(PAIR0)
    back = tap.read_jsonl(str(path))
    assert len(back) == len(rec.events) == 4
    for a, b in zip(rec.events, back):
        assert (a.path, a.step, a.total, a.kind) == (b.path, b.step, b.total, b.kind)
        assert set(b.value) == {"x", "n"}
        for k in ("x", "n"):
            assert type(b.value[k]) is type(a.value[k])
            assert b.value[k].dtype == a.value[k].dtype
            assert b.value[k].tobytes() == a.value[k].tobytes()


def _assert_same_value(a, b):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same_value(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert type(b) is type(a) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_value(x, y)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert type(b) is type(a), (a, b)
        assert b.dtype == a.dtype and b.shape == a.shape
        assert np.asarray(b).tobytes() == np.asarray(a).tobytes()
    else:
        assert type(b) is type(a) and b == a


ROUNDTRIP_VALUES = {
    "f32_scalar": np.float32(1.5),
    "f32_tenth": np.float32(0.1),
    "f64_scalar": np.float64(0.1),
    "f32_matrix": np.arange(6, dtype=np.float32).reshape(2, 3) / np.float32(7),
    "f32_special": np.array([np.nan, -np.inf, np.inf, -0.0, 1e-45], dtype=np.float32),
    "zero_d_array": np.array(2.5, dtype=np.float64),
    "int32": np.int32(-3),
    "int64_big": np.int64(2**62 + 1),
    "uint64_max": np.uint64(2**64 - 1),
    "int16_vec": np.array([1, -2], dtype=np.int16),
    "bool": np.bool_(True),
    "bool_vec": np.array([True, False]),
    "complex64": np.complex64(1.5 + 2.25j),
    "complex64_vec": np.array([1 + 2j, 3.5 - 4j], dtype=np.complex64),
    "float16": np.array([1.5, 65504], dtype=np.float16),
    "empty": np.zeros((0, 3), np.float32),
    "dict": {"a": np.float32(1.0), "b": np.int32(2)},
    "tuple": (np.float32(1.0), np.int8(-3)),
    "nested": {"t": (np.float32(1.0), [np.uint8(3), {"k": np.bool_(False)}]), "e": ()},
    "python_int": 7,
    "python_bool": True,
    "none": None,
    "empty_tuple": (),
}


@pytest.mark.parametrize("name", list(ROUNDTRIP_VALUES))
def test_read_jsonl_preserves_values(tmp_path, name):
    value = ROUNDTRIP_VALUES[name]
    path = tmp_path / f"{name}.jsonl"
    ev = tap.TapEvent("scan[0]/while[1]", 12, value, None, "output")
    with tap.JSONLWriter(str(path)) as w:
        w(ev)
    (back,) = tap.read_jsonl(str(path))
    assert isinstance(back, tap.TapEvent)
    assert (back.path, back.step, back.total, back.kind) == ("scan[0]/while[1]", 12, None, "output")
    _assert_same_value(value, back.value)


def test_read_jsonl_many_events_and_kinds(tmp_path):
    path = tmp_path / "mix.jsonl"
    evs = [
        tap.TapEvent("scan[0]", 0, np.float32(1.0), 3, "carry"),
        tap.TapEvent("scan[0]", 0, np.arange(3, dtype=np.int32), 3, "output"),
        tap.TapEvent("scan[0]/jit[0]/cholesky[0]", 1, np.eye(2, dtype=np.float32), 3, "primitive"),
        tap.TapEvent("while[0]", 41, (np.float32(2.0), np.bool_(False)), None, "carry"),
    ]
    with tap.JSONLWriter(str(path)) as w:
        for e in evs:
            w(e)
    back = tap.read_jsonl(str(path))
    assert len(back) == len(evs)
    for a, b in zip(evs, back):
        assert (a.path, a.step, a.total, a.kind) == (b.path, b.step, b.total, b.kind)
        _assert_same_value(a.value, b.value)


def test_read_jsonl_matches_recorder_for_real_program(tmp_path):
    path = tmp_path / "real.jsonl"
    rec = tap.FlightRecorder()
    with tap.JSONLWriter(str(path)) as w:
        g = tap.verbose(nested_scan, on_step=lambda e: (rec(e), w(e)))
        run(g, jnp.float32(0.5))
    back = tap.read_jsonl(str(path))
    assert len(back) == len(rec.events) == 9
    for a, b in zip(rec.events, back):
        assert (a.path, a.step, a.total, a.kind) == (b.path, b.step, b.total, b.kind)
        _assert_same_value(a.value, b.value)


def test_jsonl_readable_by_pandas(tmp_path, pd):
    path = tmp_path / "pd.jsonl"
    with tap.JSONLWriter(str(path)) as w:
        with tap.record(on_step=w) as rec:  # full leaf tuple
            pair_scan(PAIR0)
    df = pd.read_json(str(path), lines=True)
    assert len(df) == len(rec.events) == 4
    assert {"path", "step"} <= set(df.columns)
    assert df["path"].tolist() == ["scan[0]"] * 4
    assert df["step"].tolist() == [0, 1, 2, 3]
    assert df["value_0"].tolist() == PAIR_FLOATS
    assert df["value_1"].tolist() == [1, 2, 3, 4]


def test_jsonl_readable_by_pandas_dict_columns(tmp_path, pd):
    path = tmp_path / "pd_dict.jsonl"
    with tap.JSONLWriter(str(path)) as w:
        with tap.record(on_step=w, select=lambda leaves: {"pos": leaves[0], "n": leaves[1]}):
            pair_scan(PAIR0)
    df = pd.read_json(str(path), lines=True)
    assert df["pos"].tolist() == PAIR_FLOATS and df["n"].tolist() == [1, 2, 3, 4]
    assert df.groupby("path").size().to_dict() == {"scan[0]": 4}


# ---------------------------------------------------------- unwritable paths
@pytest.fixture(params=["directory", "missing_parent", "dev_full"])
def bad_path(request, tmp_path):
    if request.param == "directory":
        return str(tmp_path)
    if request.param == "missing_parent":
        return "/proc/nonexistent/x.jsonl"
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full not available")
    return "/dev/full"  # opens fine, every write fails (disk full)


@pytest.mark.parametrize("target", ["stdout's descriptor", "a file object", "None", "bytes"])
def test_a_jsonl_writer_or_timeline_takes_a_path_and_nothing_else(target, capfd):
    """An open file or a descriptor is refused when the writer is made, with
    the fix named; stdout stays open (a writer closes what it opens)."""
    import io
    import sys
    bad = {"stdout's descriptor": sys.__stdout__.fileno(), "a file object": io.StringIO(), "None": None,
           "bytes": b"run.jsonl"}[target]
    with pytest.raises(TypeError, match=r"takes a file path .* e\.g\. tap\.JSONLWriter\('run\.jsonl'\)"):
        tap.JSONLWriter(bad)
    with tap.record() as rec:
        counter_scan(jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"timeline takes a file path .* rec\.timeline\('run\.trace\.json'\)"):
        rec.timeline(bad)
    print("still open", flush=True)
    assert "still open" in capfd.readouterr().out


def test_unwritable_jsonl_warns_once_and_never_disturbs(bad_path):
    ref = counter_scan(jnp.float32(1.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = tap.JSONLWriter(bad_path)
        seen = []
        g = tap.verbose(counter_scan, on_step=lambda e: (w(e), seen.append(e)), select=lambda leaves: leaves[0])
        out1 = run(g, jnp.float32(1.0))
        out2 = run(g, jnp.float32(1.0))  # later events: silently dropped
        w(tap.TapEvent("x", 0, 1.0))
        w.close()
    tw = tap_warnings(caught)
    assert len(tw) == 1
    assert "JSONLWriter" in str(tw[0].message) and bad_path in str(tw[0].message)
    assert len(seen) == 10  # the rest of the consumer chain still ran
    assert_bitwise(out1, ref)
    assert_bitwise(out2, ref)


def test_unwritable_jsonl_with_form(tmp_path):
    ref = pair_scan(PAIR0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tap.JSONLWriter(str(tmp_path)) as w:
            with tap.record(on_step=w, select=lambda leaves: leaves[0]) as rec:
                out = pair_scan(PAIR0)
    assert len(tap_warnings(caught)) == 1
    assert len(rec.events) == 4  # the recorder is unaffected
    assert_bitwise(out, ref)


_W_ERROR_SCRIPT = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp, numpy as np
    import jaxtap as tap

    def f(x0):
        return jax.lax.scan(lambda c, _: (c * 1.5 + 0.25, c), x0, None, length=5)

    ref = f(jnp.float32(1.0))
    outs = []
    for bad in sys.argv[1:]:
        w = tap.JSONLWriter(bad)
        g = tap.verbose(f, on_step=w, select=lambda leaves: leaves[0])
        out = jax.block_until_ready(g(jnp.float32(1.0)))
        jax.effects_barrier()
        with tap.record(on_step=w, select=lambda leaves: leaves[0]):
            out2 = f(jnp.float32(1.0))
        w.close()
        for a, b in zip(jax.tree_util.tree_leaves((out, out2)), jax.tree_util.tree_leaves((ref, ref))):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        outs.append(float(out[0]))
    print("RESULT", outs)
    """
)


def test_unwritable_jsonl_under_W_error_does_not_crash(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(_W_ERROR_SCRIPT)
    bad = [str(tmp_path), "/proc/nonexistent/x.jsonl"]
    if os.path.exists("/dev/full"):
        bad.append("/dev/full")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-W", "error", str(script), *bad],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = float(counter_scan(jnp.float32(1.0))[0])
    assert proc.stdout.strip().splitlines()[-1] == f"RESULT {[expected] * len(bad)}"
    # warnings became errors, so the notice falls back to a stderr line
    assert "JSONLWriter cannot write" in proc.stderr


# ===================================================================== memory
def test_recorder_200k_scalar_events_under_60mb():
    import gc

    jax.effects_barrier()  # no callback of an earlier test may allocate meanwhile
    gc.collect()
    rec = tap.FlightRecorder()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200_000):
            rec(tap.TapEvent("scan[0]", i, np.float32(i) * np.float32(0.5), 200_000, "carry"))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(rec) == 200_000
    assert used < 60 * 2**20, f"{used / 2**20:.1f} MiB for 200k scalar events"


def test_recorded_values_are_numpy_not_device_arrays():
    with tap.record(select=lambda leaves: {"s": leaves[0], "v": jnp.stack([leaves[0], leaves[0]]),
                                            "n": leaves[1]},
                    taps=[tap.on("mul")]) as rec:
        pair_scan(PAIR0)
    assert len(rec.events) == 8

    def leaves_ok(v):
        for leaf in jax.tree_util.tree_leaves(v):
            assert not isinstance(leaf, jax.Array), type(leaf)
            assert isinstance(leaf, (np.ndarray, np.generic)), type(leaf)

    for e in rec.events:
        leaves_ok(e.value)
    carry = [e for e in rec.events if e.kind == "carry"]
    assert all(isinstance(e.value["s"], np.float32) for e in carry)  # 0-d -> numpy scalar
    assert all(isinstance(e.value["v"], np.ndarray) and e.value["v"].shape == (2,) for e in carry)


def test_recorded_events_hold_no_device_buffers():
    def long_scan(x0):
        return jax.lax.scan(lambda c, _: (c + 1.0, None), x0, None, length=2000)

    jax.block_until_ready(long_scan(jnp.float32(0.0)))
    before = len(jax.live_arrays())
    with tap.record(select=lambda leaves: leaves[0]) as rec:
        out = jax.block_until_ready(long_scan(jnp.float32(0.0)))
    del out
    assert len(rec.events) == 2000
    assert all(type(e.value) is np.float32 for e in rec.events)
    # 2000 retained events must not pin 2000 device buffers
    assert len(jax.live_arrays()) - before < 100


# ------------------------------------------------------- exactness regressions
def test_read_jsonl_keeps_complex_signed_zeros_and_infinities(tmp_path):
    path = str(tmp_path / "c.jsonl")
    values = np.array([complex(-0.0, 2.0), complex(1.0, -0.0), complex(1.0, np.inf), complex(np.nan, -np.inf)],
                      dtype=np.complex64)
    with tap.JSONLWriter(path) as out:
        for i, v in enumerate(values):
            out(tap.TapEvent("scan[0]", i, v, 4))
    back = [e.value for e in tap.read_jsonl(path)]
    for a, b in zip(values, back):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_read_jsonl_keeps_bfloat16_bits(tmp_path):
    import jax.numpy as jnp

    path = str(tmp_path / "b.jsonl")
    value = np.asarray(jnp.array([3.0, -0.0, np.inf, 1e-3], jnp.bfloat16))
    with tap.JSONLWriter(path) as out:
        out(tap.TapEvent("scan[0]", 0, value, 1))
    (back,) = [e.value for e in tap.read_jsonl(path)]
    assert back.dtype == value.dtype and back.tobytes() == value.tobytes()


def test_events_reads_as_a_snapshot_and_edits_act_on_the_recorder():
    # as 0.3.1's list attribute: an in-place edit acts on everything the
    # recorder holds, events recorded after the list was read included
    for maxlen in (None, 5):
        rec = tap.FlightRecorder(maxlen=maxlen)
        rec(tap.TapEvent("scan[0]", 0, 1.0))
        snap = rec.events
        rec(tap.TapEvent("scan[0]", 1, 2.0))
        assert len(snap) == 1 and len(rec.events) == 2  # a read is a snapshot
        snap.append(tap.TapEvent("scan[0]", 2, 3.0))
        assert [e.step for e in rec.events] == [0, 1, 2] == [e.step for e in snap]
        rec(tap.TapEvent("scan[0]", 3, 4.0))
        snap.clear()
        assert len(snap) == 0 and len(rec) == 0
        mine = list(rec.events)  # a private copy never touches the recorder
        rec(tap.TapEvent("scan[0]", 4, 5.0))
        mine.clear()
        assert len(rec) == 1
    # an edit acts on what the recorder holds now: evicted events stay gone
    rec = tap.FlightRecorder(maxlen=3)
    for step in range(3):
        rec(tap.TapEvent("scan[0]", step, float(step)))
    snap = rec.events
    for step in range(3, 6):
        rec(tap.TapEvent("scan[0]", step, float(step)))
    snap.pop(0)
    assert [e.step for e in rec.events] == [4, 5] == [e.step for e in snap]


def test_published_package_spellings_of_collectors_and_warnings():
    """Code written for jax-tap 0.3.1 imports jaxtap.collectors, filters
    UserWarning, and clears a recorder by assigning its events."""
    import warnings

    from jaxtap.collectors import FlightRecorder, JSONLWriter, read_jsonl

    assert (FlightRecorder, JSONLWriter, read_jsonl) == (tap.FlightRecorder, tap.JSONLWriter, tap.read_jsonl)
    assert issubclass(tap.TapWarning, UserWarning) and issubclass(tap.TapWarning, RuntimeWarning)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("ignore", UserWarning)
        warnings.warn("x", tap.TapWarning)
    assert w == []
    for rec, kept in ((FlightRecorder(), 3), (FlightRecorder(maxlen=2), 2)):
        g = tap.verbose(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3), on_step=rec)
        jax.block_until_ready(g(jnp.float32(0.0)))
        jax.effects_barrier()
        assert len(rec.events) == kept
        rec.events = []
        assert rec.events == [] and len(rec) == 0
        jax.block_until_ready(g(jnp.float32(0.0)))
        jax.effects_barrier()
        assert [e.step for e in rec.events] == [0, 1, 2][-kept:]  # the bound survives the assignment
        # in-place edits write through, as to 0.3.1's list attribute
        rec.events.clear()
        assert len(rec) == 0
        jax.block_until_ready(g(jnp.float32(0.0)))
        jax.effects_barrier()
        del rec.events[:1]
        rec.events.append(rec.events[0])
        assert [e.step for e in rec.events] == ([1, 2, 1] if kept == 3 else [2, 2]) and len(rec) == kept


def test_df_one_element_tuple_is_the_value_column():
    pytest.importorskip("pandas")
    rec = tap.FlightRecorder()
    for step, value in enumerate([(np.float32(1.5),), (np.float32(2.5),)]):
        rec.append(tap.TapEvent(path="scan[0]", step=step, value=value, total=2, kind="carry"))
    df = rec.df()
    assert list(df.columns) == ["path", "step", "value"] and df["value"].tolist() == [1.5, 2.5]
    rec2 = tap.FlightRecorder()
    rec2.append(tap.TapEvent(path="scan[0]", step=0, value=(np.float32(1.0), np.float32(2.0)), total=1, kind="carry"))
    assert list(rec2.df().columns) == ["path", "step", "value_0", "value_1"]


def test_alert_once_still_calls_the_alert_on_every_event(capfd):
    calls = []

    def alert(e):
        calls.append(e.step)
        return "big" if float(e.value) > 1.0 else None

    g = tap.verbose(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=4)[0],
                    alert=alert, alert_once=True, select=lambda leaves: leaves[0])
    jax.block_until_ready(g(jnp.float32(0.0)))
    jax.effects_barrier()
    assert calls == [0, 1, 2, 3]
    assert capfd.readouterr().err.count("FAIL") == 1
