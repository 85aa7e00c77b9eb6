"""Code written against the published jax-tap 0.3.1 runs unchanged.

Issue 12's numbered points, each in both forms where it applies: primitive
events reach ``on_step`` (by kind), a primitive tap outside any loop has no
step (``-1``) and no total, primitive-tap values (``select=None`` gives the
outputs' tuple; ``output=k`` gives the bare array, to ``select`` too), and
path-aware ``select`` in ``tap.on``. Points 5-7 and 9 are in
test_collectors.py / test_toolkit.py; 0.3.1 JSONL files in test_jsonl_files.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap
from taputil import assert_bits, sync


def chol_loop(x):
    def body(c, _):
        m = jnp.eye(2) * c
        return c + jnp.linalg.cholesky(m)[0, 0], None

    return jax.lax.scan(body, x, None, length=3)[0]


def chol_once(x):
    return jnp.linalg.cholesky(jnp.eye(2) * x)[1, 1]


def _both_forms(f, x, **cfg):
    """Events of ``f(x)`` in the wrapping form and in the with-form (outputs checked bitwise)."""
    rec_v = tap.FlightRecorder()
    g = tap.verbose(f, on_step=rec_v, **cfg)
    assert_bits(sync(g(x)), f(x))
    with tap.record(**cfg) as rec_w:
        out = sync(f(x))
    assert_bits(out, f(x))
    return rec_v.events, rec_w.events


def _prims(events):
    return [e for e in events if e.kind == "primitive"]


# ---------------------------------------------------------------- point 1
@pytest.mark.parametrize("form", ["wrapping", "with"])
def test_on_step_gets_primitive_events_after_the_alert_and_the_recorder(form):
    order = []

    def alert(v):
        order.append("alert")
        return False

    def on_step(e):
        order.append((e.kind, len(rec.events)))  # the recorder already holds this event

    cfg = dict(taps=[tap.on("cholesky", alert=alert)], where=lambda path: False, on_step=on_step)
    if form == "wrapping":
        g, rec = tap.record(chol_loop, **cfg)
        sync(g(jnp.float32(2.0)))
    else:
        with tap.record(**cfg) as rec:
            sync(chol_loop(jnp.float32(2.0)))
    assert order == ["alert", ("primitive", 1), "alert", ("primitive", 2), "alert", ("primitive", 3)]


def test_progress_consumers_count_carries_only():
    # the CLI's bars and BlackJAX's progress_bar() read on_step; a bar that
    # counts steps must filter by kind, and ours does (see test_cli.py); here:
    # the carry stream through on_step is exactly what it was without the tap
    def carries(taps):
        seen = []
        with tap.record(on_step=seen.append, select=lambda _: (), taps=taps):
            sync(chol_loop(jnp.float32(2.0)))
        return [(e.path, e.step, e.total) for e in seen if e.kind == "carry"]

    assert carries([tap.on("cholesky")]) == carries([]) == [("scan[0]", i, 3) for i in range(3)]


# ---------------------------------------------------------------- point 2
def test_a_primitive_tap_outside_any_loop_has_no_step_and_no_total(capfd):
    for events in _both_forms(chol_once, jnp.float32(4.0), taps=[tap.on("cholesky"), tap.print("cholesky")]):
        prims = _prims(events)
        assert [(e.path, e.step, e.total) for e in prims] == [("cholesky[0]", -1, None)] * 2
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("[tap]")]
    assert lines == ["[tap] cholesky[0]: array([[2., 0.], [0., 2.]], dtype=float32)"] * 2


def test_inside_a_loop_steps_and_totals_are_unchanged():
    for events in _both_forms(chol_loop, jnp.float32(2.0), taps=[tap.on("cholesky")]):
        assert [(e.step, e.total) for e in _prims(events)] == [(i, 3) for i in range(3)]


# ---------------------------------------------------------------- point 3
def test_select_none_gives_the_tuple_of_outputs():
    for events in _both_forms(chol_loop, jnp.float32(4.0), taps=[tap.on("cholesky")]):
        v = _prims(events)[0].value
        assert isinstance(v, tuple) and len(v) == 1
        np.testing.assert_array_equal(v[0], np.eye(2, dtype=np.float32) * 2.0)


def test_output_k_gives_select_and_the_event_the_bare_array():
    got = []

    def select(x):
        got.append(isinstance(x, tuple))
        return x[0, 0]  # indexes the array, not a tuple

    for events in _both_forms(chol_loop, jnp.float32(4.0), taps=[tap.on("cholesky", output=0, select=select)]):
        values = [e.value for e in _prims(events)]
        assert len(values) == 3 and float(values[0]) == 2.0 and np.shape(values[0]) == ()
    assert got and not any(got)
    for events in _both_forms(chol_loop, jnp.float32(4.0), taps=[tap.on("cholesky", output=0)]):
        v = _prims(events)[0].value
        assert isinstance(v, np.ndarray) and v.shape == (2, 2)


def test_select_with_output_none_still_gets_the_tuple():
    for events in _both_forms(chol_loop, jnp.float32(4.0),
                              taps=[tap.on("cholesky", select=lambda outs: outs[0][1, 1])]):
        assert float(_prims(events)[0].value) == 2.0


# ---------------------------------------------------------------- point 4
@pytest.mark.parametrize("spelling", ["keyword", "positional"])
def test_path_aware_select_in_tap_on(spelling):
    seen_paths = []

    if spelling == "keyword":
        def select(outs, *, path):
            seen_paths.append(path)
            return outs[0][0, 0] * (2.0 if path.startswith("scan[0]") else 1.0)
    else:
        def select(outs, path):
            seen_paths.append(path)
            return outs[0][0, 0] * (2.0 if path.startswith("scan[0]") else 1.0)

    for events in _both_forms(chol_loop, jnp.float32(4.0), taps=[tap.on("cholesky", select=select)]):
        assert float(_prims(events)[0].value) == 4.0  # 2 * sqrt(4), doubled inside scan[0]
    assert set(seen_paths) == {"scan[0]/jit[0]/cholesky[0]"}


def test_path_aware_select_with_output_k_gets_the_array_and_the_path():
    def select(x, path):
        assert not isinstance(x, tuple)
        return x.sum() + (0.0 if path.endswith("cholesky[0]") else jnp.nan)

    for events in _both_forms(chol_loop, jnp.float32(4.0), taps=[tap.on("cholesky", output=0, select=select)]):
        assert float(_prims(events)[0].value) == 4.0


def test_blackjax_progress_bar_counts_steps_inside_a_block_with_a_primitive_tap():
    blackjax = pytest.importorskip("blackjax")
    steps, kinds = [], []
    with tap.record(taps=[tap.on("cholesky")], on_step=lambda e: kinds.append(e.kind)) as rec:
        with blackjax.progress_bar(label="t") as state:
            real = state._step_callback
            state._step_callback = lambda idx: (steps.append(int(idx)), real(idx))
            out = sync(chol_loop(jnp.float32(2.0)))
        assert kinds == []  # the innermost block (the bar) owns what runs inside it
        sync(chol_loop(jnp.float32(2.0)))
    assert_bits(out, chol_loop(jnp.float32(2.0)))
    assert steps == [0, 1, 2] and state.n_steps == 3  # the bar counts carries only
    assert sorted(kinds) == ["carry"] * 3 + ["primitive"] * 3 and len(rec.events) == 6


# ------------------------------------------- addresses: a helper called from two lines
def _helper(x):
    return jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=2)[0]


def _model(x):
    a = _helper(x)
    return _helper(a * 10.0)


def test_a_helper_called_from_two_lines_gets_two_addresses_in_both_forms():
    for events in _both_forms(_model, jnp.float32(0.0)):
        assert [(e.path, e.step, float(e.value[0])) for e in events] == [
            ("scan[0]", 0, 1.0), ("scan[0]", 1, 2.0), ("scan[1]", 0, 21.0), ("scan[1]", 1, 22.0)]
    # where= can now pick one of them
    for events in _both_forms(_model, jnp.float32(0.0), where=lambda path: path == "scan[1]"):
        assert {e.path for e in events} == {"scan[1]"} and len(events) == 2


def test_a_jitted_function_keeps_its_address_whichever_line_calls_it():
    f = jax.jit(_model)
    with tap.record() as rec:
        sync(f(jnp.float32(0.0)))
        sync(f(jnp.float32(1.0)))  # another line, the cached compilation
        sync(f(jnp.ones(2)))  # another line and a retrace
    assert [e.path for e in rec.events] == ["scan[0]", "scan[0]", "scan[1]", "scan[1]"] * 3
