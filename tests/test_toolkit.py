"""The debugging toolkit: primitive taps (tap.on / tap.watch_nan / tap.print),
tap.primitives discovery, and carry alerts (alert= / alert_once=).

Spec: README sections "The debugging toolkit", "Carry alerts", "Quick start".
stderr lines are compared as exact strings (via capfd).
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap
from taputil import assert_bits as assert_bitwise


# --------------------------------------------------------------------- helpers
def run(g, *args):
    """Run a B-form function to completion and flush every host callback."""
    out = jax.block_until_ready(g(*args))
    jax.effects_barrier()
    return out


def tap_lines(capfd):
    """The "[tap] ..." lines written to stderr since the last read."""
    err = capfd.readouterr().err
    return [line for line in err.splitlines() if line.startswith("[tap]")]




def sin_scan(x0, xs):
    def body(c, x):
        return c * 1.01 + jnp.sin(x), c

    return jax.lax.scan(body, x0, xs)


def chol_scan(c0):
    """cholesky(eye(2) * c) for c = c0, c0-1, ...: NaN once c hits 0."""

    def body(c, _):
        L = jnp.linalg.cholesky(jnp.eye(2, dtype=jnp.float32) * c)
        return c - 1.0, L

    return jax.lax.scan(body, c0, None, length=3)


def eigh_scan(c0):
    """eigh(diag([1, 2]) * c) for c = c0, c0+1, ..."""

    def body(c, _):
        w, v = jnp.linalg.eigh(jnp.diag(jnp.array([1.0, 2.0], dtype=jnp.float32)) * c)
        return c + 1.0, None

    return jax.lax.scan(body, c0, None, length=2)


def log_nested(x0):
    """Outer scan c = 3, 2, 1, 0; inner scan d <- d + log(d - 1), twice.

    The inner log first goes non-finite at outer step 2 (log(0) = -inf),
    inner step 0; it is non-finite again at outer step 3.
    """

    def outer(c, _):
        def inner(d, _):
            return d + jnp.log(d - 1.0), None

        jax.lax.scan(inner, c, None, length=2)
        return c - 1.0, None

    return jax.lax.scan(outer, x0, None, length=4)


# ======================================================== tap.print line format
def test_print_line_format_in_scan(capfd, form):
    x0, xs = jnp.float32(0.0), jnp.linspace(0.0, 1.0, 3, dtype=jnp.float32)
    out, _ = form.run(sin_scan, x0, xs, taps=[tap.print("sin"), tap.print("mul")])
    # mul = c * 1.01 on the incoming carry: 0, 0, 1.01 * sin(0.5); within a
    # step the two print in program order (which JAX versions differ on)
    lines = tap_lines(capfd)
    assert [line.split(" ")[2] for line in lines] == ["0/3:", "0/3:", "1/3:", "1/3:", "2/3:", "2/3:"]
    assert sorted(lines) == [
        "[tap] scan[0]/mul[0] 0/3: array([0.], dtype=float32)",
        "[tap] scan[0]/mul[0] 1/3: array([0.], dtype=float32)",
        "[tap] scan[0]/mul[0] 2/3: array([0.4842], dtype=float32)",
        "[tap] scan[0]/sin[0] 0/3: array([0.], dtype=float32)",
        "[tap] scan[0]/sin[0] 1/3: array([0.4794], dtype=float32)",
        "[tap] scan[0]/sin[0] 2/3: array([0.8415], dtype=float32)",
    ]
    assert_bitwise(out, sin_scan(x0, xs))


def test_print_two_d_array_on_one_line(capfd):
    g = tap.verbose(chol_scan, taps=[tap.print("cholesky")])
    run(g, jnp.float32(4.0))
    lines = tap_lines(capfd)
    assert lines[:2] == [
        "[tap] scan[0]/jit[0]/cholesky[0] 0/3: array([[2., 0.], [0., 2.]], dtype=float32)",
        "[tap] scan[0]/jit[0]/cholesky[0] 1/3: array([[1.7321, 0.    ], [0.    , 1.7321]], dtype=float32)",
    ]
    assert len(lines) == 3


def _expected_repr(a):
    with np.printoptions(precision=4, threshold=8, edgeitems=2):
        text = repr(a)
    return " ".join(part.strip() for part in text.splitlines())


def test_print_truncates_large_arrays_with_printoptions(capfd):
    g = tap.verbose(lambda x: x * 2.0, taps=[tap.print("mul")])
    x = np.arange(36.0, dtype=np.float32).reshape(6, 6)
    run(g, jnp.asarray(x))
    lines = tap_lines(capfd)
    assert lines == ["[tap] mul[0]: " + _expected_repr(x * 2.0)]
    line = lines[0]
    # truncated rows *and* columns, edgeitems=2, on a single line
    assert "..." in line and "\n" not in line
    assert "[ 0.,  2., ...,  8., 10.]" in line and "[60., 62., ..., 68., 70.]" in line


def test_print_small_array_not_truncated(capfd):
    g = tap.verbose(lambda x: x * 2.0, taps=[tap.print("mul")])
    run(g, jnp.arange(8.0, dtype=jnp.float32))  # 8 elements == threshold
    assert tap_lines(capfd) == [
        "[tap] mul[0]: array([ 0.,  2.,  4.,  6.,  8., 10., 12., 14.], dtype=float32)"
    ]


def test_print_multi_output_primitive_in_primitive_order(capfd):
    g = tap.verbose(eigh_scan, taps=[tap.print("eigh")])
    run(g, jnp.float32(1.0))
    # eigh primitive outputs (eigenvectors, eigenvalues) - not jnp's (w, v)
    assert tap_lines(capfd) == [
        "[tap] scan[0]/jit[0]/eigh[0] 0/2: array([[1., 0.], [0., 1.]], dtype=float32), array([1., 2.], dtype=float32)",
        "[tap] scan[0]/jit[0]/eigh[0] 1/2: array([[1., 0.], [0., 1.]], dtype=float32), array([2., 4.], dtype=float32)",
    ]


def test_print_output_index_selects_primitive_output(capfd):
    g = tap.verbose(eigh_scan, taps=[tap.print("eigh", output=1)])
    run(g, jnp.float32(1.0))
    assert tap_lines(capfd) == [
        "[tap] scan[0]/jit[0]/eigh[0] 0/2: array([1., 2.], dtype=float32)",
        "[tap] scan[0]/jit[0]/eigh[0] 1/2: array([2., 4.], dtype=float32)",
    ]


def test_print_inside_while_loop_total_is_question_mark(capfd):
    def w(x):
        return jax.lax.while_loop(lambda c: c < 3.0, lambda c: c + jnp.sin(c) + 1.0, x)

    g = tap.verbose(w, taps=[tap.print("sin")])
    out = run(g, jnp.float32(0.0))
    assert tap_lines(capfd) == [
        "[tap] while[0]/sin[0] 0/?: array([0.], dtype=float32)",
        "[tap] while[0]/sin[0] 1/?: array([0.8415], dtype=float32)",
        "[tap] while[0]/sin[0] 2/?: array([0.2956], dtype=float32)",
    ]
    assert_bitwise(out, w(jnp.float32(0.0)))


def test_print_outside_any_loop_reads_0_of_1(capfd):
    g = tap.verbose(lambda x: jnp.sin(x), taps=[tap.print("sin")])
    run(g, jnp.float32(0.5))
    assert tap_lines(capfd) == ["[tap] sin[0]: array([0.4794], dtype=float32)"]


def test_print_once_prints_first_firing_per_address(capfd):
    def two_sins(x0):
        return jax.lax.scan(lambda c, _: (jnp.sin(c) + jnp.sin(2.0 * c), None), x0, None, length=4)

    g = tap.verbose(two_sins, taps=[tap.print("sin", once=True)])
    run(g, jnp.float32(1.0))
    lines = tap_lines(capfd)
    # the two addresses fire in the same step; their relative order is free
    assert sorted(line.split(":")[0] for line in lines) == [
        "[tap] scan[0]/sin[0] 0/4",
        "[tap] scan[0]/sin[1] 0/4",
    ]


# =================================================================== addresses
def test_cholesky_is_a_jit_inside_the_scan():
    counts = tap.primitives(chol_scan, jnp.float32(2.0))
    assert counts["cholesky"] == 1 and counts["jit"] >= 1 and counts["scan"] == 1


def test_user_jit_helper_inside_scan_address(capfd):
    @jax.jit
    def helper(x):
        return jnp.sin(x) * 2.0

    def s(x0):
        return jax.lax.scan(lambda c, _: (helper(c), None), x0, None, length=2)

    with tap.record(taps=[tap.print("sin")]):
        s(jnp.float32(1.0))
    with tap.record(taps=[tap.print("sin")]):
        jax.jit(s)(jnp.float32(1.0))  # an outer jit is transparent
    expected = [
        "[tap] scan[0]/jit[0]/sin[0] 0/2: array([0.8415], dtype=float32)",
        "[tap] scan[0]/jit[0]/sin[0] 1/2: array([0.9937], dtype=float32)",
    ]
    assert tap_lines(capfd) == expected + expected


# =================================================================== watch_nan
def test_watch_nan_fail_line_b_form(capfd):
    g = tap.verbose(chol_scan, taps=[tap.watch_nan("cholesky")])
    out = run(g, jnp.float32(2.0))
    # c = 2, 1, 0: only cholesky(0) is non-finite
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/jit[0]/cholesky[0] 2/3: NaN/Inf"]
    assert_bitwise(out, chol_scan(jnp.float32(2.0)))


def test_watch_nan_custom_label_and_with_form(capfd):
    with tap.record(taps=[tap.watch_nan("cholesky", label="L went bad")]) as rec:
        out = chol_scan(jnp.float32(2.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/jit[0]/cholesky[0] 2/3: L went bad"]
    prim = [e for e in rec.events if e.kind == "primitive"]
    # the check runs on device; only the firing that trips reaches the host
    assert [(e.path, e.step, e.total, bool(e.value)) for e in prim] == [
        ("scan[0]/jit[0]/cholesky[0]", 2, 3, False),
    ]
    assert_bitwise(out, chol_scan(jnp.float32(2.0)))


def test_watch_nan_silent_when_finite(capfd):
    g = tap.verbose(chol_scan, taps=[tap.watch_nan("cholesky")])
    run(g, jnp.float32(5.0))  # c = 5, 4, 3: all positive definite
    assert tap_lines(capfd) == []


def test_watch_nan_without_once_fires_every_bad_step(capfd):
    g = tap.verbose(log_nested, taps=[tap.watch_nan("log")])
    run(g, jnp.float32(3.0))
    lines = tap_lines(capfd)
    assert lines[0] == "[tap] FAIL scan[0]/scan[0]/log[0] 0/2: NaN/Inf"
    assert len(lines) >= 3  # outer step 2 (both inner steps) and outer step 3
    assert all(line.startswith("[tap] FAIL scan[0]/scan[0]/log[0] ") for line in lines)


def test_watch_nan_once_per_address_per_call_b_form(capfd):
    g = tap.verbose(log_nested, taps=[tap.watch_nan("log", once=True)])
    run(g, jnp.float32(3.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/scan[0]/log[0] 0/2: NaN/Inf"]
    run(g, jnp.float32(3.0))  # a new call: fires again, once
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/scan[0]/log[0] 0/2: NaN/Inf"]


def test_watch_nan_once_is_per_address_not_global(capfd):
    def two_logs(x0):
        def body(c, _):
            a = jnp.log(c)         # log[0]: -inf at c = 0
            b = jnp.log(c - 1.0)   # log[1]: -inf at c = 1
            return c - 1.0, a + b

        return jax.lax.scan(body, x0, None, length=4)

    g = tap.verbose(two_logs, taps=[tap.watch_nan("log", once=True)])
    run(g, jnp.float32(2.0))  # c = 2, 1, 0, -1
    assert tap_lines(capfd) == [
        "[tap] FAIL scan[0]/log[1] 1/4: NaN/Inf",
        "[tap] FAIL scan[0]/log[0] 2/4: NaN/Inf",
    ]


def test_watch_nan_once_per_with_block(capfd):
    with tap.record(taps=[tap.watch_nan("log", once=True)]):
        for _ in range(2):  # one line, one address: the second run is already fired
            log_nested(jnp.float32(3.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/scan[0]/log[0] 0/2: NaN/Inf"]
    with tap.record(taps=[tap.watch_nan("log", once=True)]):
        log_nested(jnp.float32(3.0))  # a new block fires again
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/scan[0]/log[0] 0/2: NaN/Inf"]


def test_primitive_taps_ignore_max_depth(capfd, form):
    out, events = form.run(log_nested, jnp.float32(3.0), max_depth=0, select=lambda _: (),
                           taps=[tap.watch_nan("log", once=True)])
    # the inner loop is filtered for carry events ...
    assert {e.path for e in events if e.kind == "carry"} == {"scan[0]"}
    assert sum(e.kind == "carry" for e in events) == 4
    # ... but the primitive tap two loops deep still fires
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/scan[0]/log[0] 0/2: NaN/Inf"]
    # once=True silences the line, not the events
    assert {(e.path, e.kind) for e in events if e.kind != "carry"} == {("scan[0]/scan[0]/log[0]", "primitive")}
    assert_bitwise(out, log_nested(jnp.float32(3.0)))


def test_primitive_taps_gated_by_sample_every(capfd):
    def f(x0):
        return jax.lax.scan(lambda c, _: (c + jnp.sin(c), None), x0, None, length=7)

    g, rec = tap.record(f, sample_every=3, taps=[tap.print("sin")])
    run(g, jnp.float32(1.0))
    steps = [line.split(" ")[2] for line in tap_lines(capfd)]
    assert steps == ["0/7:", "3/7:", "6/7:"]
    assert [e.step for e in rec.events if e.kind == "primitive"] == [0, 3, 6]


def test_watch_nan_sample_every_can_skip_the_bad_step(capfd):
    # the only NaN is at step 2; sample_every=2 observes steps 0 and 2 ...
    g = tap.verbose(chol_scan, sample_every=2, taps=[tap.watch_nan("cholesky")])
    run(g, jnp.float32(2.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/jit[0]/cholesky[0] 2/3: NaN/Inf"]
    # ... but a shifted start puts the bad step at 1, which is never sampled
    g = tap.verbose(chol_scan, sample_every=2, taps=[tap.watch_nan("cholesky")])
    run(g, jnp.float32(1.0))  # c = 1, 0, -1: non-finite at steps 1 and 2
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/jit[0]/cholesky[0] 2/3: NaN/Inf"]


# ====================================================================== tap.on
def test_on_alert_str_is_the_message(capfd):
    def f(x0, xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sin(x), None), x0, xs)

    xs = jnp.array([0.0, 1.5, 0.2, 1.4], dtype=jnp.float32)
    g = tap.verbose(f, taps=[tap.on("sin", alert=lambda v: f"sin={float(v[0]):.2f}" if v[0] > 0.9 else None)])
    run(g, jnp.float32(0.0), xs)
    assert tap_lines(capfd) == [
        "[tap] FAIL scan[0]/sin[0] 1/4: sin=1.00",
        "[tap] FAIL scan[0]/sin[0] 3/4: sin=0.99",
    ]


def test_on_alert_truthy_uses_label_or_default(capfd):
    def f(x0, xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sin(x), None), x0, xs)

    xs = jnp.array([0.0, 1.5, 0.2], dtype=jnp.float32)
    g = tap.verbose(f, taps=[tap.on("sin", select=lambda outs: outs[0], alert=lambda v: v > 0.8,
                                    label="sin exceeded 0.8")])
    run(g, jnp.float32(0.0), xs)
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/sin[0] 1/3: sin exceeded 0.8"]
    g = tap.verbose(f, taps=[tap.on("sin", alert=lambda v: v[0] > 0.8)])  # no select: the outputs' tuple
    run(g, jnp.float32(0.0), xs)
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/sin[0] 1/3: alert"]


def test_on_select_reduces_on_device_and_alert_sees_selected(capfd):
    seen = []

    def alert(v):
        seen.append(v)
        return v > 5

    g = tap.verbose(eigh_scan, taps=[tap.on("eigh", select=lambda outs: outs[1].sum(), alert=alert, label="big")])
    run(g, jnp.float32(1.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0]/jit[0]/eigh[0] 1/2: big"]
    assert [float(v) for v in seen] == [3.0, 6.0]
    assert all(isinstance(v, np.generic) and v.shape == () for v in seen)


def test_on_output_index_picks_the_primitive_output():
    g, rec = tap.record(eigh_scan, taps=[tap.on("eigh", output=1)])
    run(g, jnp.float32(1.0))
    vals = [e.value for e in rec.events if e.kind == "primitive"]
    assert len(vals) == 2
    np.testing.assert_array_equal(vals[0], np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(vals[1], np.array([2.0, 4.0], np.float32))

    g, rec = tap.record(eigh_scan, taps=[tap.on("eigh", output=0)])
    run(g, jnp.float32(1.0))
    vecs = [e.value for e in rec.events if e.kind == "primitive"]
    assert all(v.shape == (2, 2) for v in vecs)
    np.testing.assert_array_equal(np.abs(vecs[0]), np.eye(2, dtype=np.float32))


def test_on_without_select_ships_all_outputs_as_tuple():
    g, rec = tap.record(eigh_scan, taps=[tap.on("eigh")])
    run(g, jnp.float32(1.0))
    v = [e.value for e in rec.events if e.kind == "primitive"][0]
    assert isinstance(v, tuple) and len(v) == 2
    assert v[0].shape == (2, 2) and v[1].shape == (2,)


def test_on_alert_raising_warns_once_program_unchanged(capfd):
    def bad(v):
        raise RuntimeError("boom")

    x0, xs = jnp.float32(0.0), jnp.linspace(0.0, 1.0, 5, dtype=jnp.float32)
    g = tap.verbose(sin_scan, taps=[tap.on("sin", alert=bad)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = run(g, x0, xs)
    tap_warnings = [x for x in w if issubclass(x.category, tap.TapWarning)]
    assert len(tap_warnings) == 1 and "boom" in str(tap_warnings[0].message)
    assert tap_lines(capfd) == []
    assert_bitwise(out, sin_scan(x0, xs))


# ============================================== routing of primitive events
def test_primitive_events_reach_recorder_and_on_step_by_kind_with_form():
    seen = []
    x0, xs = jnp.float32(0.0), jnp.linspace(0.0, 1.0, 3, dtype=jnp.float32)
    with tap.record(on_step=seen.append, select=lambda l: l[0], taps=[tap.on("sin")]) as rec:
        sin_scan(x0, xs)
    prim = [e for e in rec.events if e.kind == "primitive"]
    carry = [e for e in rec.events if e.kind == "carry"]
    assert [(e.path, e.step, e.total) for e in prim] == [("scan[0]/sin[0]", i, 3) for i in range(3)]
    np.testing.assert_allclose([float(e.value[0]) for e in prim], np.sin(np.linspace(0.0, 1.0, 3)), rtol=1e-6)
    assert [(e.path, e.step) for e in carry] == [("scan[0]", i) for i in range(3)]
    # on_step sees every event, as the recorder does (0.3.1); kind tells them apart
    assert [(e.path, e.step, e.kind) for e in seen] == [(e.path, e.step, e.kind) for e in rec.events]


def test_primitive_events_reach_on_step_b_form():
    seen = []
    g, rec = tap.record(sin_scan, on_step=seen.append, taps=[tap.on("sin")])
    run(g, jnp.float32(0.0), jnp.linspace(0.0, 1.0, 4, dtype=jnp.float32))
    assert sum(e.kind == "primitive" for e in rec.events) == 4
    assert sorted((e.kind, e.step) for e in seen) == sorted((e.kind, e.step) for e in rec.events)
    assert sum(e.kind == "carry" for e in seen) == 4


def test_a_lone_primitive_tap_reaches_on_step_in_verbose():
    # without alert or print, on_step is how tap.on reaches the user in tap.verbose
    seen = []
    g = tap.verbose(sin_scan, on_step=seen.append, where=lambda path: False, taps=[tap.on("sin", output=0)])
    run(g, jnp.float32(0.0), jnp.linspace(0.0, 1.0, 3, dtype=jnp.float32))
    assert [(e.path, e.step, e.kind) for e in seen] == [("scan[0]/sin[0]", i, "primitive") for i in range(3)]
    assert all(isinstance(e.value, np.ndarray) or np.isscalar(e.value) for e in seen)


# ================================================================ unmatched
def test_unmatched_tap_name_warns_with_suggestion(capfd, form):
    with pytest.warns(tap.TapWarning, match=r"'cholsky'.*did you mean 'cholesky'\?"):
        out, _ = form.run(chol_scan, jnp.float32(2.0), taps=[tap.watch_nan("cholsky")])
    assert_bitwise(out, chol_scan(jnp.float32(2.0)))
    assert tap_lines(capfd) == []  # nothing matched: no FAIL line despite the NaN


def test_matched_tap_name_does_not_warn():
    g = tap.verbose(chol_scan, taps=[tap.watch_nan("cholesky")])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        run(g, jnp.float32(5.0))
    assert not [x for x in w if issubclass(x.category, tap.TapWarning)]


# ============================================================ tap.primitives
def test_primitives_counts_nested_bodies_branches_and_jits():
    traces = []

    @jax.jit
    def helper(x):
        return jnp.exp(x) - 1.0

    def f(x0):
        traces.append(1)

        def inner_body(c):
            return jax.lax.cond(c > 0.0, jnp.sin, jnp.cos, c) + 1.0

        def body(c, _):
            d = jax.lax.while_loop(lambda d: d < 3.0, inner_body, c)
            return helper(d), None

        return jax.lax.scan(body, x0, None, length=2)

    counts = tap.primitives(f, jnp.float32(0.0))
    assert len(traces) == 1  # traced exactly once
    assert isinstance(counts, dict)
    for name in ("scan", "while", "cond", "sin", "cos", "exp", "jit"):
        assert counts.get(name) == 1, (name, counts)
    assert counts["sub"] == 1  # the inner jit's body is counted
    assert all(isinstance(k, str) and isinstance(v, int) and v >= 1 for k, v in counts.items())


def test_primitives_quick_start_example():
    counts = tap.primitives(sin_scan, jnp.float32(0.0), jnp.linspace(0.0, 1.0, 100))
    assert counts["scan"] == 1 and counts["sin"] == 1 and counts["mul"] == 1 and counts["add"] == 1


def test_primitives_counts_repeats():
    def f(x):
        return jnp.sin(jnp.sin(x)) + jnp.sin(x)

    assert tap.primitives(f, jnp.float32(1.0))["sin"] == 3


def test_primitives_rejects_non_callable():
    with pytest.raises(TypeError):
        tap.primitives(123, jnp.float32(1.0))


# ================================================================ carry alerts
def accumulator(x0):
    def body(carry, step_frac):
        return carry + step_frac, carry

    xs = jnp.linspace(0.0, 2.0, 10, dtype=jnp.float32)
    return jax.lax.scan(body, x0, xs)


def threshold_alert(e):
    return f"carry={float(e.value):.2f} exceeded 5.0" if float(e.value) > 5.0 else False


def test_carry_alert_readme_example(capfd):
    with tap.record(select=lambda leaves: leaves[0], alert=threshold_alert, alert_once=True) as rec:
        out = accumulator(jnp.float32(0.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0] 7/10: carry=6.22 exceeded 5.0"]
    assert len(rec.events) == 10  # alert does not filter recording
    assert_bitwise(out, accumulator(jnp.float32(0.0)))


def test_carry_alert_without_once_fires_every_step(capfd):
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=threshold_alert)
    run(g, jnp.float32(0.0))
    lines = tap_lines(capfd)
    assert [line.split(":")[0] for line in lines] == [f"[tap] FAIL scan[0] {s}/10" for s in (7, 8, 9)]
    assert lines[-1] == "[tap] FAIL scan[0] 9/10: carry=10.00 exceeded 5.0"


def test_carry_alert_truthy_non_str_prints_alert(capfd):
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=lambda e: e.step == 3)
    run(g, jnp.float32(0.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0] 3/10: alert"]


def test_carry_alert_receives_the_tap_event():
    got = []
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=lambda e: got.append(e))
    run(g, jnp.float32(0.0))
    assert [(e.path, e.step, e.total, e.kind) for e in got] == [("scan[0]", i, 10, "carry") for i in range(10)]
    assert all(isinstance(e, tap.TapEvent) for e in got)


def test_carry_alert_runs_before_on_step():
    order = []
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0],
                    alert=lambda e: order.append(("alert", e.step)),
                    on_step=lambda e: order.append(("on_step", e.step)))
    run(g, jnp.float32(0.0))
    assert order[:4] == [("alert", 0), ("on_step", 0), ("alert", 1), ("on_step", 1)]
    assert len(order) == 20


def test_carry_alert_once_per_path_per_call_b_form(capfd):
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=threshold_alert, alert_once=True)
    run(g, jnp.float32(0.0))
    assert tap_lines(capfd) == ["[tap] FAIL scan[0] 7/10: carry=6.22 exceeded 5.0"]
    run(g, jnp.float32(0.0))  # second call fires again, once
    assert tap_lines(capfd) == ["[tap] FAIL scan[0] 7/10: carry=6.22 exceeded 5.0"]


def test_carry_alert_once_is_per_path(capfd):
    def nested(x0):
        def outer(c, _):
            d, _ = jax.lax.scan(lambda d, _: (d + 1.0, None), c, None, length=3)
            return c + 1.0, None

        return jax.lax.scan(outer, x0, None, length=3)

    g = tap.verbose(nested, select=lambda leaves: leaves[0], alert=lambda e: float(e.value) >= 2.0,
                    alert_once=True)
    run(g, jnp.float32(0.0))
    lines = tap_lines(capfd)
    assert sorted(lines) == sorted([
        "[tap] FAIL scan[0]/scan[0] 1/3: alert",  # inner: 0 -> 1, 2 at step 1
        "[tap] FAIL scan[0] 1/3: alert",          # outer: 1, 2 at step 1
    ])


def test_carry_alert_gated_by_sample_every():
    got = []
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=lambda e: got.append(e.step),
                    sample_every=4)
    run(g, jnp.float32(0.0))
    assert got == [0, 4, 8]


def test_carry_alert_ambiguous_truth_warns_once_result_unchanged(capfd):
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=lambda e: np.array([1, 2]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = run(g, jnp.float32(0.0))
        out2 = run(g, jnp.float32(0.0))
    tap_warnings = [x for x in w if issubclass(x.category, tap.TapWarning)]
    assert len(tap_warnings) == 1
    assert "alert" in str(tap_warnings[0].message)
    assert tap_lines(capfd) == []
    assert_bitwise(out, accumulator(jnp.float32(0.0)))
    assert_bitwise(out2, accumulator(jnp.float32(0.0)))


def test_carry_alert_raising_does_not_block_on_step(capfd):
    seen = []

    def bad(e):
        raise ValueError("nope")

    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=bad, on_step=seen.append)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = run(g, jnp.float32(0.0))
    assert len([x for x in w if issubclass(x.category, tap.TapWarning)]) == 1
    assert [e.step for e in seen] == list(range(10))
    assert_bitwise(out, accumulator(jnp.float32(0.0)))


def test_compiled_program_identical_with_or_without_alert(form):
    cb = lambda e: None  # noqa: E731
    sel = lambda leaves: leaves[0]  # noqa: E731
    x0 = jnp.float32(0.0)
    plain = form.lowered(accumulator, x0, on_step=cb, select=sel)
    alerted = form.lowered(accumulator, x0, on_step=cb, select=sel, alert=threshold_alert, alert_once=True)
    assert plain != jax.jit(accumulator).lower(x0).as_text()  # really tapped
    assert plain == alerted


def test_alert_only_still_observes():
    # alert alone is a consumer: the program is tapped and the alert runs
    got = []
    g = tap.verbose(accumulator, select=lambda leaves: leaves[0], alert=lambda e: got.append(e.step))
    run(g, jnp.float32(0.0))
    assert got == list(range(10))


# ================================================================= bad input
def test_on_rejects_non_str_name():
    with pytest.raises(TypeError, match=r"primitive name.*123") as ei:
        tap.on(123)
    assert "tap.primitives" in str(ei.value)


@pytest.mark.parametrize("maker", [tap.on, tap.watch_nan, tap.print])
def test_empty_name_rejected(maker):
    with pytest.raises(TypeError, match="primitive name"):
        maker("")


def test_on_rejects_negative_output():
    with pytest.raises(ValueError, match=r"`output`.*-1"):
        tap.on("sin", output=-1)


@pytest.mark.parametrize("bad", [True, 1.0, "0"])
def test_output_rejects_non_int(bad):
    with pytest.raises((TypeError, ValueError), match="output"):
        tap.print("sin", output=bad)


def test_watch_nan_rejects_non_bool_once():
    with pytest.raises(TypeError, match=r"`once`.*'yes'"):
        tap.watch_nan("log", once="yes")


def test_on_rejects_non_callable_alert_and_select():
    with pytest.raises(TypeError, match="alert"):
        tap.on("sin", alert=3)
    with pytest.raises(TypeError, match="select"):
        tap.on("sin", select="outs[0]")
    with pytest.raises(TypeError, match="select"):
        tap.print("sin", select=1)


def test_label_must_be_str():
    with pytest.raises(TypeError, match="label"):
        tap.watch_nan("log", label=5)


def test_taps_must_be_tap_objects():
    with pytest.raises(TypeError, match="taps"):
        tap.verbose(sin_scan, taps=["sin"])
    with pytest.raises(TypeError, match="taps"):
        tap.record(taps=[lambda x: x])
    with pytest.raises(TypeError, match=r"taps=\[tap.watch_nan"):
        tap.record(taps=5)


@pytest.mark.parametrize("form", ["verbose", "with"])
def test_one_tap_alone_is_a_list_of_one(capfd, form):
    bad = lambda x: jax.lax.scan(lambda c, _: (jnp.log(c - 2.0), None), x, None, length=3)[0]  # noqa: E731
    if form == "verbose":
        out = tap.verbose(bad, taps=tap.watch_nan("log"))(jnp.float32(1.0))
    else:
        with tap.record(taps=tap.watch_nan("log")):
            out = bad(jnp.float32(1.0))
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert "[tap] FAIL" in capfd.readouterr().err


def test_primitives_lists_only_what_a_tap_can_reach():
    """Inside a primitive the walker binds unchanged (custom_linear_solve's
    operator and solves) nothing can be tapped: tap.primitives does not list
    it, and a tap on such a name warns that it matched nothing."""
    import warnings

    A, b = jnp.eye(3) * 2.0, jnp.ones(3)
    f = lambda A, b: jnp.linalg.solve(A, b)  # noqa: E731
    names = tap.primitives(f, A, b)
    assert "custom_linear_solve" in names and "dot_general" not in names
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tap.verbose(f, taps=[tap.print("dot_general")])(A, b)
    assert any("'dot_general' matched nothing" in str(x.message) for x in w)


def test_the_matched_nothing_hint_names_only_the_users_primitives():
    """A jit traced in the block holds jax-tap's own loops and hops; the hint
    listing what the program has must not name them (jaxtap_callback, ...)."""
    g = jax.jit(lambda x: jax.lax.scan(lambda c, y: (c * y, None), x, x)[0])
    x = jnp.ones(3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with tap.record(taps=[tap.on("div")]):
            g(x)
            jax.jit(lambda x: g(x) + 1)(x)
    (hint,) = [str(m.message) for m in w if "matched nothing" in str(m.message)]
    assert "mul" in hint and "jaxtap" not in hint and "custom_jvp_call" not in hint, hint


def test_a_tap_on_an_output_the_primitive_lacks_is_a_clear_error_in_both_forms():
    a = jnp.eye(3, dtype=jnp.float32) * 2.0

    def f(a):
        return jax.lax.scan(lambda c, _: (c + jnp.linalg.eigh(c)[0].sum(), None), a, None, length=2)[0]

    def g(a):
        return jnp.linalg.eigh(a)[0]  # outside any loop

    # (one configuration per function: a block reuses the jit traces of an
    # earlier block with the same configuration, README "With-form and JAX's caches")
    for fn, k in ((f, 99), (g, 7)):
        with pytest.raises(tap.TapSelectError, match=rf"'eigh' asks for output={k}, but eigh has 2 outputs: "
                                                     r"use output=0\.\.1"):
            tap.verbose(fn, taps=[tap.on("eigh", output=k)])(a)
        with pytest.raises(tap.TapSelectError, match=f"output={k}"):
            with tap.record(taps=[tap.on("eigh", output=k)]):
                fn(a)


@pytest.mark.parametrize("make", [tap.on, tap.print, tap.watch_nan], ids=["on", "print", "watch_nan"])
@pytest.mark.parametrize("name", ["scan", "while"])
def test_a_loop_name_is_not_a_primitive_tap(make, name):
    # `tap.primitives` lists loops; their carries are what record/verbose tap
    with pytest.raises(ValueError, match="is a loop"):
        make(name)


COMBINERS = {  # a reduction's or scatter's combiner: a computation XLA applies, never tapped
    "x.at[1].add": lambda: jnp.zeros(3).at[1].add(2.0),
    "grad of x[idx]": lambda: jax.grad(lambda v: v[jnp.array([0, 2, 2])].sum())(jnp.ones(3)),
    "scan with .at[].add": lambda: jax.lax.scan(lambda c, _: (c.at[0].add(1.0), None), jnp.zeros(2), None,
                                                length=3)[0],
    "segment_sum": lambda: jax.ops.segment_sum(jnp.arange(4.0), jnp.array([0, 0, 1, 1]), num_segments=2),
    "lax.reduce, custom": lambda: jax.lax.reduce(jnp.ones((2, 3)), 0.0, lambda a, b: a + b * 2.0, (1,)),
    "lax.reduce_window, custom": lambda: jax.lax.reduce_window(jnp.ones((2, 3)), 0.0, lambda a, b: a + b * 2.0,
                                                               (1, 2), (1, 1), "VALID"),
}


@pytest.mark.parametrize("make", [tap.on, tap.watch_nan], ids=["on", "watch_nan"])
@pytest.mark.parametrize("name", sorted(COMBINERS))
def test_taps_never_enter_a_combiner(name, make):
    want = COMBINERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tap.TapWarning)  # ("matched nothing" where the only adds are combiners)
        for prim in ("add", "mul"):
            with tap.record(taps=[make(prim)]):
                got = jax.block_until_ready(COMBINERS[name]())
            assert_bitwise(got, want)
