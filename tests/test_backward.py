"""Cotangent taps (``backward=True``): a scan's backward loop reports at its
forward loop's address, ``kind="cotangent"``, ``step`` = the forward step,
``select`` on the cotangent of the forward carry (``.params``: the closed-over
values' accumulated cotangents); gradients stay bitwise."""
import collections
import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from taputil import assert_bits, sync

import jaxtap as tap
from jaxtap import _seam

T = 6
W = jnp.float32(0.9)
XS = jnp.linspace(0.0, 1.0, T, dtype=jnp.float32)


def _by_path_and_kind(events) -> dict:
    """How many events each (path, kind) has."""
    return dict(collections.Counter((e.path, e.kind) for e in events))


def step_fn(w, c, x):
    return jnp.sin(w * c) + x


def loss(w, xs):
    c, _ = jax.lax.scan(lambda c, x: (step_fn(w, c, x), None), jnp.float32(0.3), xs)
    return c


def carry_before(t):
    """The forward carry entering step t (host reference)."""
    c = jnp.float32(0.3)
    for s in range(t):
        c = step_fn(W, c, XS[s])
    return c


def cotangent_ref(t):
    """d loss / d (carry entering step t), by differentiating the rest of the loop."""
    rest = lambda c: jax.lax.scan(lambda c, x: (step_fn(W, c, x), None), c, XS[t:])[0]  # noqa: E731
    return jax.grad(rest)(carry_before(t))


def _grad_under(form, fn, **kw):
    if form == "with":
        with tap.record(backward=True, **kw) as rec:
            out = sync(fn())
        return out, rec.events
    seen = []
    out = sync(tap.verbose(lambda: fn(), backward=True, on_step=seen.append, **kw)())
    return out, seen


@pytest.mark.parametrize("form", ["with", "verbose"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_cotangent_events_at_the_forward_address_in_forward_steps(form, jit):
    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    ref = grad(W, XS)
    got, events = _grad_under(form, lambda: grad(W, XS), select=lambda ct: (ct[0], ct.params))
    assert_bits(ref, got, "gradient")
    fwd = [e for e in events if e.kind == "carry"]
    bwd = [e for e in events if e.kind == "cotangent"]
    assert [e.step for e in fwd] == list(range(T))
    assert [e.step for e in bwd] == list(range(T - 1, -1, -1))  # execution order: the forward steps, reversed
    assert {e.path for e in events} == {"scan[0]"} and {e.total for e in events} == {T}
    assert all(e.backward is True for e in bwd) and all(e.backward is None for e in fwd)
    assert all(e.value[1] == () for e in fwd)  # one select serves both directions
    for e in bwd:  # the cotangent of the carry entering forward step e.step
        np.testing.assert_allclose(e.value[0], cotangent_ref(e.step), rtol=1e-5)
    # .params accumulates the closed-over w's cotangent: all of it after step 0
    np.testing.assert_allclose(bwd[-1].value[1][0], ref, rtol=1e-6)
    assert fwd[-1] == events[T - 1]  # every forward event before the first backward one


def test_progress_idiom_under_jit_grad_gives_n_forward_then_n_backward_events():
    """A jax.debug.callback in a scan body under jit(grad) is hoisted out of
    the backward pass; cotangent taps are not: N forward, then N backward."""
    n = 50
    xs = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
    with tap.record(backward=True, select=lambda _: ()) as rec:
        sync(jax.jit(jax.grad(loss))(W, xs))
    kinds = [e.kind for e in rec.events]
    assert kinds == ["carry"] * n + ["cotangent"] * n
    assert [e.step for e in rec.events] == list(range(n)) + list(range(n - 1, -1, -1))
    assert all(e.value == () for e in rec.events)


_UNORDERED = ("JAX >= 0.11's XLA runs the events-only forward loop after a backward pass that needs no "
              "forward residual: nothing orders them (README, 'The backward pass', Order)")


@pytest.mark.parametrize("flush_every", [
    pytest.param(None, marks=pytest.mark.xfail(_seam.JAX_VERSION >= (0, 11), reason=_UNORDERED, strict=True)),
    3])
def test_forward_events_precede_the_backward_ones_when_nothing_else_orders_them(flush_every):
    """A linear loop: its backward pass needs no forward residual, so only
    the lens' own loop structure keeps the forward run first under jit."""
    def linear(x):
        body = lambda c, _: (jax.lax.fori_loop(0, 3, lambda i, a: a * 0.9 + c, c), None)  # noqa: E731
        return jax.lax.scan(body, x, None, length=4)[0]

    with tap.record(backward=True, select=lambda _: (), flush_every=flush_every) as rec:
        sync(jax.jit(jax.grad(linear))(jnp.float32(0.3)))
    top = [(e.kind, e.step) for e in rec.events if e.path == "scan[0]"]
    assert top == [("carry", s) for s in range(4)] + [("cotangent", s) for s in range(3, -1, -1)]


def test_carry_leaves_keep_the_forward_order_zeros_where_no_cotangent():
    def f(w, xs):
        def body(carry, x):
            n, c, free = carry
            return (n + 1, jnp.sin(w * c) + x, free * 2.0), None
        (n, c, free), _ = jax.lax.scan(body, (0, jnp.float32(0.3), jnp.float32(1.0)), xs)
        return c + free

    with tap.record(backward=True) as rec:
        g = sync(jax.grad(f)(W, XS))
    assert_bits(jax.grad(f)(W, XS), g)
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert len(bwd) == T
    for e in bwd:
        n, c, free = e.value
        assert n.dtype == np.int32 and n == 0  # an integer counter has no cotangent
        assert free == 0.0  # nor does a leaf that does not depend on w
        np.testing.assert_allclose(c, cotangent_ref(e.step), rtol=1e-5)


def nested_loss(w, xs):
    def inner(c, t):
        return jnp.sin(c * w) + t * c, jnp.sum(c)

    def body(c, x):
        c2, ys = jax.lax.scan(inner, c, x)
        c3 = jax.lax.cond(jnp.sum(c2) > 0.0, lambda u: u * 0.5 + w, lambda u: jnp.cos(u) * w, c2)
        return c3, jnp.sum(ys)

    c, ys = jax.lax.scan(body, jnp.full((3,), 0.1, jnp.float32) * w, xs)
    return jnp.sum(c * c) + jnp.sum(ys) * 0.01


NXS = jnp.cos(jnp.arange(5 * 4 * 3, dtype=jnp.float32)).reshape(5, 4, 3) * 0.5


@pytest.mark.parametrize("flush_every", [None, 3])
def test_nested_backward_loops_report_at_their_forward_addresses(flush_every):
    ref = jax.jit(jax.grad(nested_loss))(W, NXS)
    with tap.record(backward=True, select=lambda ct: jnp.sum(ct[0]), flush_every=flush_every) as rec:
        got = sync(jax.jit(jax.grad(nested_loss))(W, NXS))
    assert_bits(ref, got)
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert sorted({e.path for e in rec.events}) == ["scan[0]", "scan[0]/scan[0]"]
    outer = [e.step for e in bwd if e.path == "scan[0]"]
    inner = [e.step for e in bwd if e.path == "scan[0]/scan[0]"]
    assert outer == [4, 3, 2, 1, 0]
    assert inner == [3, 2, 1, 0] * 5
    assert all(e.total == (5 if e.path == "scan[0]" else 4) for e in bwd)


def test_fori_loop_with_static_bounds():
    f = lambda w: jax.lax.fori_loop(0, 5, lambda i, c: c * w + 1.0, jnp.float32(1.0))  # noqa: E731
    with tap.record(backward=True) as rec:
        g = sync(jax.grad(f)(jnp.float32(2.0)))
    assert_bits(jax.grad(f)(jnp.float32(2.0)), g)
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert [e.step for e in bwd] == [4, 3, 2, 1, 0]
    assert [float(e.value[1]) for e in bwd] == [2.0, 4.0, 8.0, 16.0, 32.0]  # d out / d c_t = w**(5-t)


def ckpt_loss(w, xs):
    @jax.checkpoint
    def body(c, x):
        c2, _ = jax.lax.scan(lambda a, t: (jnp.sin(a * w + t), None), c, x)
        return c2, jnp.cos(c2)

    c, ys = jax.lax.scan(body, jnp.ones(3, jnp.float32) * 0.1, xs)
    return jnp.sum(c) + jnp.sum(ys)


CXS = jnp.ones((4, 3, 3), jnp.float32) * 0.2


@pytest.mark.parametrize("where", ["body", "around the loss"])
def test_checkpointed_body_recomputed_forward_is_not_a_second_forward_pass(where):
    fn = ckpt_loss if where == "body" else jax.checkpoint(ckpt_loss)  # (around: JVP + partial evaluation)
    ref = jax.grad(fn)(W, CXS)
    with tap.record(backward=True) as rec:
        got = sync(jax.grad(fn)(W, CXS))
    assert_bits(ref, got)
    assert _by_path_and_kind(rec.events) == {("scan[0]", "carry"): 4, ("scan[0]/scan[0]", "carry"): 12,
                                             ("scan[0]", "cotangent"): 4, ("scan[0]/scan[0]", "cotangent"): 12}


def _nest2(c):
    return jax.lax.scan(lambda c, _: (jnp.sin(c) * 0.9, None), c, None, length=3)[0]


def _nest1(c):
    return jax.lax.scan(lambda c, _: (_nest2(c) * 1.1, None), c, None, length=2)[0]


def _deep_ckpt_loss(x):
    return jax.lax.scan(jax.checkpoint(lambda c, _: (_nest1(c), None)), x, None, length=4)[0].sum()


@pytest.mark.parametrize("form", ["eager", "jit"])
def test_forward_loops_recomputed_at_any_depth_are_not_a_second_forward_pass(form):
    """A checkpointed step recomputes a nest two loops deep inside the backward
    step: neither depth is reported as forward carry again (the second level
    was, doubling its events; found with diffrax's DirectAdjoint)."""
    g = jax.grad(_deep_ckpt_loss) if form == "eager" else jax.jit(jax.grad(_deep_ckpt_loss))
    x = jnp.ones(3, jnp.float32)
    ref = g(x)
    with tap.record(backward=True) as rec:
        got = sync(g(x))
    assert_bits(ref, got)
    forward = {("scan[0]", "carry"): 4, ("scan[0]/scan[0]", "carry"): 8, ("scan[0]/scan[0]/scan[0]", "carry"): 24}
    assert _by_path_and_kind(rec.events) == {**forward, **{(p, "cotangent"): n for (p, _), n in forward.items()}}


@jax.custom_vjp
def _halve(x):
    return x * 0.5


def _halve_bwd(_, g):  # a user's own backward-only iterative solver
    return (jax.lax.while_loop(lambda c: c[1] < 4, lambda c: (c[0] * 0.5 + g * 0.1, c[1] + 1), (g, 0))[0],)


_halve.defvjp(lambda x: (_halve(x), None), _halve_bwd)


def test_a_custom_vjp_bwd_loop_inside_a_backward_step_is_reported():
    """Only recomputations of the forward pass are silenced in a backward step:
    a custom_vjp's own bwd while loop there is reported (4 steps x 3)."""
    loss = jax.jit(jax.grad(lambda x: jax.lax.scan(lambda c, _: (jnp.sin(_halve(c)), None), x, None,
                                                   length=3)[0].sum()))
    x = jnp.arange(3.0, dtype=jnp.float32)
    ref = loss(x)
    with tap.record(backward=True) as rec:
        got = sync(loss(x))
    assert_bits(ref, got)
    assert _by_path_and_kind(rec.events) == {("scan[0]", "carry"): 3, ("scan[0]", "cotangent"): 3,
                                             ("scan[0]/while[0]", "carry"): 12}


def test_without_the_option_backward_loops_are_loops_of_their_own():
    with tap.record() as rec:
        sync(jax.grad(loss)(W, XS))
    assert {e.path for e in rec.events} == {"scan[0]", "scan[1]"}
    assert {e.kind for e in rec.events} == {"carry"} and all(e.backward is None for e in rec.events)


def test_vmap_of_grad_tags_lanes():
    ws = jnp.stack([W, W * 0.5])
    ref = jax.vmap(jax.grad(loss), (0, None))(ws, XS)
    with tap.record(backward=True, select=lambda ct: ct[0]) as rec:
        got = sync(jax.vmap(jax.grad(loss), (0, None))(ws, XS))
    assert_bits(ref, got)
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert sorted((e.step, e.lane) for e in bwd) == sorted((t, ln) for t in range(T) for ln in (0, 1))
    lane0 = {e.step: e.value for e in bwd if e.lane == 0}
    for t in range(T):
        np.testing.assert_allclose(lane0[t], cotangent_ref(t), rtol=1e-5)


def test_vjp_and_linear_transpose():
    with tap.record(backward=True, select=lambda ct: ct[0]) as rec:
        out, pullback = jax.vjp(lambda w: loss(w, XS), W)
        sync(pullback(jnp.float32(1.0)))
    assert [e.step for e in rec.events if e.kind == "cotangent"] == list(range(T - 1, -1, -1))

    def lin(x):
        return jax.lax.scan(lambda c, t: (c * 2.0 + t * x, c), x, jnp.ones(4, jnp.float32))[0]

    ref = jax.linear_transpose(lin, jnp.float32(1.0))(jnp.float32(2.0))
    with tap.record(backward=True) as rec:
        got = sync(jax.linear_transpose(lin, jnp.float32(1.0))(jnp.float32(2.0)))
    assert_bits(ref, got)
    assert [(e.path, e.step, float(e.value[0])) for e in rec.events] == [
        ("scan[0]", 3, 4.0), ("scan[0]", 2, 8.0), ("scan[0]", 1, 16.0), ("scan[0]", 0, 32.0)]


def exploding(w, xs):
    def body(c, x):
        c = jnp.sin(w * c) + x  # the derivative of this line overflows in the backward pass
        return c, c
    return jnp.sum(jax.lax.scan(body, jnp.float32(0.5), xs)[1])


EXPLODE_LINE = inspect.getsourcelines(exploding)[1] + 2


def test_watch_nan_names_a_nan_born_in_the_backward_pass(capfd):
    """The forward pass is finite; the cotangent overflows (w=50, 100 steps):
    the FAIL line names the forward loop, the forward step, the primitive and
    the user line whose derivative produced it."""
    xs = jnp.zeros(100, jnp.float32)
    w = jnp.float32(50.0)
    assert np.isfinite(exploding(w, xs)) and not np.isfinite(jax.grad(exploding)(w, xs))
    with tap.record(backward=True, taps=[tap.watch_nan()]) as rec:
        g = sync(jax.grad(exploding)(w, xs))
    assert_bits(jax.grad(exploding)(w, xs), g)
    fails = [e for e in rec.events if e.kind == "primitive"]
    assert len(fails) == 1
    e = fails[0]
    assert e.backward is True and e.path.startswith("scan[0]/") and e.total == 100
    assert e.value == f"{e.path.split('/')[-1].split('[')[0]} at test_backward.py:{EXPLODE_LINE}"
    line = f"[tap] FAIL {e.path} (backward) {e.step}/100: NaN/Inf born in {e.value}"
    assert line in capfd.readouterr().err
    # the forward pass of the same step is finite: this is a backward birth
    assert all(np.isfinite(v.value[0]) for v in rec.events if v.kind == "carry")


def test_while_loop_has_no_reverse_mode_with_or_without_the_lens():
    f = lambda w: jax.lax.while_loop(lambda c: c < 10.0, lambda c: c * w, jnp.float32(1.0))  # noqa: E731
    with pytest.raises(ValueError) as plain:
        jax.grad(f)(jnp.float32(2.0))
    with tap.record(backward=True):
        with pytest.raises(ValueError) as tapped:
            jax.grad(f)(jnp.float32(2.0))
    assert type(plain.value) is type(tapped.value)


def test_jax_rules_are_jaxs_own_outside_a_backward_block():
    from jax._src.interpreters import ad
    from jax._src.lax.control_flow import loops

    before = (ad.primitive_linearizations[loops.scan_p], ad.fancy_transposes[loops.scan_p],
              ad.primitive_jvps[loops.scan_p])
    with tap.record(backward=True):
        assert ad.fancy_transposes[loops.scan_p] is not before[1]
        sync(jax.grad(loss)(W, XS))
    assert (ad.primitive_linearizations[loops.scan_p], ad.fancy_transposes[loops.scan_p],
            ad.primitive_jvps[loops.scan_p]) == before
    assert_bits(jax.grad(loss)(W, XS), jax.grad(loss)(W, XS))  # a copy made meanwhile still works


def test_bad_backward_option_is_a_clear_error():
    with pytest.raises(TypeError, match="backward"):
        tap.record(backward="yes")


def test_jsonl_and_frame_keep_the_backward_tag(tmp_path):
    path = tmp_path / "run.jsonl"
    with tap.record(backward=True, select=lambda ct: ct[0], on_step=tap.JSONLWriter(str(path))) as rec:
        sync(jax.grad(loss)(W, XS))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x.get("backward") for x in lines] == [None] * T + [True] * T
    back = tap.read_jsonl(str(path))
    assert [(e.kind, e.step, e.backward) for e in back] == [(e.kind, e.step, e.backward) for e in rec.events]
    pytest.importorskip("pandas")
    df = rec.df(kind=True)
    assert list(df["backward"].fillna(False)) == [False] * T + [True] * T
    assert list(df["kind"]) == ["carry"] * T + ["cotangent"] * T


CLI_SCRIPT = '''
import jax, jax.numpy as jnp

def loss(w, xs):
    def body(c, x):
        c = jnp.sin(w * c) + x
        return c, c
    return jnp.sum(jax.lax.scan(body, jnp.float32(0.5), xs)[1])

print("grad", float(jax.jit(jax.grad(loss))(jnp.float32(50.0), jnp.zeros(100, jnp.float32))))
'''


def test_cli_backward_watch_nan(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(CLI_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_ENABLE_X64", None)
    r = subprocess.run([sys.executable, "-m", "jaxtap", "--backward", "--watch-nan", "--summary", "train.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "grad nan" in r.stdout
    fails = [ln for ln in r.stderr.splitlines() if ln.startswith("[tap] FAIL")]
    assert len(fails) == 1, r.stderr[-2000:]
    assert " (backward) " in fails[0] and "/100: NaN/Inf born in " in fails[0] and "at train.py:6" in fails[0]
    assert fails[0].startswith("[tap] FAIL scan[0]/")


@pytest.mark.parametrize("flush_every", [None, 4])
def test_sample_every_samples_the_same_forward_steps_in_both_directions(flush_every):
    n, every = 23, 5
    xs = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
    grad = jax.jit(jax.grad(loss))
    with tap.record(backward=True, sample_every=every, flush_every=flush_every, select=lambda ct: ct[0]) as rec:
        g = sync(grad(W, xs))
    assert_bits(jax.jit(jax.grad(loss))(W, xs), g)
    want = list(range(0, n, every))
    assert [e.step for e in rec.events if e.kind == "carry"] == want
    assert [e.step for e in rec.events if e.kind == "cotangent"] == want[::-1]
    # primitive taps in the backward loop sample the same forward steps (a
    # primitive tap reads an intermediate: not part of the bitwise claim)
    with tap.record(backward=True, sample_every=every, flush_every=flush_every, taps=[tap.on("mul")]) as rec:
        sync(grad(W, xs))
    prims = [e for e in rec.events if e.kind == "primitive" and e.backward]
    assert prims and sorted({e.step for e in prims}) == want


def _truncated_cotangent(body, c_t, xs_rest, out):
    """d out(final carry) / d (carry entering the first step of xs_rest)."""
    return jax.grad(lambda c: out(jax.lax.scan(body, c, xs_rest)[0]))(c_t)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_carry_leaf_that_never_reaches_the_loss_keeps_the_layout(jit):
    """JAX drops the tangent of a carry leaf that never reaches the loss
    from the backward loop (dead code): the other leaves keep their places."""
    def body_w(w):
        def body(c, x):
            a, b, d = c
            return (jnp.sin(a * w) + x, b * w, d * 0.5 + a), None  # b never reaches the loss
        return body

    c0 = (jnp.float32(0.3), jnp.float32(0.2), jnp.float32(0.1))
    xs = XS[:3]
    out = lambda c: c[0] + 3.0 * c[2]  # noqa: E731
    f = lambda w: out(jax.lax.scan(body_w(w), c0, xs)[0])  # noqa: E731
    grad = jax.jit(jax.grad(f)) if jit else jax.grad(f)
    with tap.record(backward=True) as rec:
        g = sync(grad(W))
    assert_bits(grad(W), g)
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert [e.step for e in bwd] == [2, 1, 0]
    carries = [c0]
    for x in xs:
        carries.append(body_w(W)(carries[-1], x)[0])
    for e in bwd:
        ref = _truncated_cotangent(body_w(W), carries[e.step], xs[e.step:], out)
        assert len(e.value) == 3 and e.value[1] == 0.0
        np.testing.assert_allclose([e.value[0], e.value[2]], [ref[0], ref[2]], rtol=1e-5)


def test_checkpointed_body_with_an_inner_reversed_scan_of_the_same_length():
    """The forward scan recomputed inside the backward step is not taken for
    the backward scan the transpose binds."""
    xs = jnp.linspace(0.1, 1.0, 3, dtype=jnp.float32)

    def f(w, xs):
        @jax.checkpoint
        def outer(c, x):
            d = jax.lax.scan(lambda d, y: (jnp.sin(d * w) + y, None), c, xs, reverse=True)[0]
            return d * x, None
        return jax.lax.scan(outer, jnp.float32(0.3), xs)[0]

    with tap.record(backward=True) as rec:
        g = sync(jax.jit(jax.grad(f))(W, xs))
    assert_bits(jax.jit(jax.grad(f))(W, xs), g)
    assert _by_path_and_kind(rec.events) == {("scan[0]", "carry"): 3, ("scan[0]/scan[0]", "carry"): 9,
                                             ("scan[0]", "cotangent"): 3, ("scan[0]/scan[0]", "cotangent"): 9}


def test_a_select_returning_what_it_received_ships_leaves_and_params():
    with tap.record(backward=True, select=lambda ct: ct) as rec:
        sync(jax.grad(loss)(W, XS))
    last = rec.events[-1]
    assert last.kind == "cotangent" and isinstance(last.value[0], np.floating)
    np.testing.assert_allclose(last.value.params[0], jax.grad(loss)(W, XS), rtol=1e-6)
    assert rec.events[0].value.params == ()


def test_a_prng_key_carry_leaf_reads_as_zero_key_data():
    def f(w):
        def body(c, _):
            key, x = c
            key, sub = jax.random.split(key)
            return (key, jnp.sin(w * x) + jax.random.normal(sub)), None
        return jax.lax.scan(body, (jax.random.key(0), jnp.float32(0.5)), None, length=3)[0][1]

    with tap.record(backward=True) as rec:
        sync(jax.grad(f)(W))
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert len(bwd) == 3
    for e in bwd:
        assert e.value[0].dtype == np.uint32 and e.value[0].shape == (2,) and not e.value[0].any()


@pytest.mark.parametrize("flush_every", [None, 2])
def test_grad_of_vmap_gives_lanes_in_both_directions(flush_every):
    """vmap inside grad (a batched loss): the backward loop is bound after
    batching, yet its events come per lane, as the forward ones do."""
    def per_example(w, x):
        return jax.lax.scan(lambda c, t: (step_fn(w, c, t * x), None), jnp.float32(0.3), XS[:4])[0]

    xs = jnp.array([0.1, 0.5, 0.9], jnp.float32)
    f = lambda w: jnp.sum(jax.vmap(per_example, (None, 0))(w, xs))  # noqa: E731
    with tap.record(backward=True, select=lambda ct: (ct[0], ct.params), flush_every=flush_every) as rec:
        g = sync(jax.jit(jax.grad(f))(W))
    assert_bits(jax.jit(jax.grad(f))(W), g)
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert sorted((e.step, e.lane) for e in bwd) == sorted((t, ln) for t in range(4) for ln in range(3))
    for e in bwd:
        x = xs[e.lane]
        c_t = jnp.float32(0.3)
        for s in range(e.step):
            c_t = step_fn(W, c_t, XS[s] * x)
        rest = lambda c: jax.lax.scan(lambda c, t: (step_fn(W, c, t * x), None), c, XS[e.step:4])[0]  # noqa: E731
        np.testing.assert_allclose(e.value[0], jax.grad(rest)(c_t), rtol=1e-5)
    at0 = [e for e in bwd if e.step == 0]
    np.testing.assert_allclose(at0[0].value[1][0], g, rtol=1e-6)  # .params: shared by the lanes, summed over them


def _helper_scan(c, w, n):
    return jax.lax.scan(lambda d, y: (jnp.sin(d * w) + y, None), c, jnp.linspace(0.0, 1.0, n, dtype=jnp.float32))[0]


def test_backward_loops_in_cond_branches_find_their_own_forward_twins():
    """One helper's scan in two branches of a switch (one source line,
    lengths 2 and 3): each backward loop at its own twin's address."""
    def f(w):
        def body(c, x):
            i = jnp.clip((x * 3).astype(jnp.int32), 0, 2)
            c = jax.lax.switch(i, [lambda c: _helper_scan(c, w, 2), lambda c: c * w,
                                   lambda c: _helper_scan(c, w * 0.5, 3)], c)
            return c + x, None
        return jax.lax.scan(body, jnp.float32(0.3), jnp.linspace(0.1, 1.0, 5, dtype=jnp.float32))[0]

    with tap.record(backward=True) as rec:
        g = sync(jax.grad(f)(W))
    assert_bits(jax.grad(f)(W), g)
    totals = {}
    for e in rec.events:
        totals.setdefault(e.path, set()).add(e.total)
    assert totals == {"scan[0]": {5}, "scan[0]/scan[0]": {2}, "scan[0]/scan[1]": {3}}
    kinds = {(e.path, e.kind) for e in rec.events}
    assert ("scan[0]/scan[0]", "cotangent") in kinds and ("scan[0]/scan[1]", "cotangent") in kinds


def test_a_backward_loop_whose_twin_cannot_be_told_apart_is_never_mislabelled():
    """inner(inner(c)): two forward loops of one line and one length in one
    body. Their backward loops run unreported rather than at a wrong address."""
    def f(w):
        def body(c, x):
            return _helper_scan(_helper_scan(c, w, 2), w * 0.5, 2) + x, None
        return jax.lax.scan(body, jnp.float32(0.3), XS[:3])[0]

    with tap.record(backward=True) as rec:
        g = sync(jax.grad(f)(W))
    assert_bits(jax.grad(f)(W), g)
    assert _by_path_and_kind(rec.events) == {("scan[0]", "carry"): 3, ("scan[0]", "cotangent"): 3,
                                             ("scan[0]/scan[0]", "carry"): 6, ("scan[0]/scan[1]", "carry"): 6}


def test_what_one_block_learnt_never_decides_for_the_next():
    """A forward record left by an earlier block does not pick the layout of
    a later program at the same line whose own layout is ambiguous."""
    c0 = (jnp.float32(0.3), jnp.float32(0.2), jnp.float32(0.1), jnp.float32(0.4))

    def rnn(body, out, w):  # one scan line shared by both programs
        return out(jax.lax.scan(body(w), c0, XS[:3])[0])

    body_p = lambda w: lambda c, x: ((c[0] * w + x, jnp.sin(c[1] * w), c[2] * 2.0, c[3] * w), None)  # noqa: E731
    body_b = lambda w: lambda c, x: ((jax.lax.stop_gradient(c[0]) * w + x, c[1] * w,  # noqa: E731
                                      c[2] + jnp.sin(c[1]), c[3] * w), None)
    with tap.record(backward=True):
        sync(jax.grad(lambda w: rnn(body_p, lambda c: c[0] + c[1] + c[3], w))(W))
    fb = jax.checkpoint(lambda w: rnn(body_b, lambda c: c[0] + 3.0 * c[2], w))
    with tap.record(backward=True) as rec:
        g = sync(jax.grad(fb)(W))
    assert_bits(jax.grad(fb)(W), g)
    # two layouts fit its types: a loop of its own address, never mislabelled
    assert not [e for e in rec.events if e.kind == "cotangent"]
    assert {e.path for e in rec.events} == {"scan[0]", "scan[1]"}


def test_a_select_returning_its_path_under_grad_of_vmap():
    def per_example(w, x):
        return jax.lax.scan(lambda c, t: (step_fn(w, c, t * x), None), jnp.float32(0.3), XS[:4])[0]

    f = lambda w: jnp.sum(jax.vmap(per_example, (None, 0))(w, jnp.array([0.1, 0.5], jnp.float32)))  # noqa: E731
    with tap.record(backward=True, select=lambda ct, path: (ct[0], path)) as rec:
        sync(jax.grad(f)(W))
    bwd = [e for e in rec.events if e.kind == "cotangent"]
    assert len(bwd) == 8 and {e.lane for e in bwd} == {0, 1}
    assert all(e.value[1] == "scan[0]" and np.ndim(e.value[0]) == 0 for e in bwd)
