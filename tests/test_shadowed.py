"""Loops that run as written, their tapped form a copy for the events.

A short scan (XLA unrolls a loop whose trip count it knows) and a loop whose
body holds primitive taps (a tap is one more reader of a value the user's
fusion keeps inside) run as the user wrote them; a copy of the tapped form
runs on the same inputs for the events alone (``_rules.shadowed``). On JAX
0.12.1's XLA:CPU, which contracts a multiply feeding an add into one FMA in
some unrolled steps and only where the product has one reader, both broke
bit-for-bit identity before; every JAX must keep it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from taputil import assert_bits, sync

import jaxtap as tap

pytestmark = pytest.mark.filterwarnings("ignore:.*matched nothing")

BODIES = {
    "sin": lambda c, x: c * 1.01 + jnp.sin(x),
    "cos": lambda c, x: c * 0.99 + jnp.cos(x * c),
    "exp": lambda c, x: c * 0.9 + jnp.exp(-x) * c,
}


def _scan(body):
    def f(c0, xs):
        return jax.lax.scan(lambda c, x: (body(c, x), c), c0, xs)
    return f


@pytest.mark.parametrize("body", sorted(BODIES))
def test_short_scans_are_bitwise_at_every_length(body):
    # the README's quickstart program is the 5-step "sin" one
    bad = []
    for n in list(range(1, 41)) + [64]:
        xs = jnp.linspace(0.5, 4.0, n, dtype=jnp.float32)
        f = jax.jit(_scan(BODIES[body]))
        ref = f(jnp.float32(0.3), xs)
        with tap.record(select=lambda leaves: leaves[0]) as rec:
            out = sync(jax.jit(_scan(BODIES[body]))(jnp.float32(0.3), xs))
        if not all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))):
            bad.append(n)
        assert [e.step for e in rec.events] == list(range(n))
    assert bad == []


@pytest.mark.parametrize("taps", [[tap.on("mul")], [tap.on("add")], [tap.watch_nan("mul")], [tap.watch_nan()],
                                  [tap.on("mul", select=lambda o: o[0] * 2)]],
                         ids=["on_mul", "on_add", "nan_mul", "nan_births", "on_mul_select"])
@pytest.mark.parametrize("n", [5, 100])
def test_a_tapped_product_leaves_the_users_multiply_add_alone(taps, n):
    def f(c0, xs):
        def body(c, x):
            return c * 1.01 + x * 0.3, c
        return jax.lax.scan(body, c0, xs)

    xs = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
    ref = jax.jit(f)(jnp.float32(0.1), xs)
    for form in (f, jax.jit(f)):
        with tap.record(taps=taps) as rec:
            out = sync(form(jnp.float32(0.1), xs))
        assert_bits(ref, out)
        prim = [e for e in rec.events if e.kind == "primitive"]
        assert len(prim) == (2 * n if taps[0].mode == "on" and taps[0].prim == "mul" else
                             n if taps[0].mode == "on" else 0)


def test_a_tapped_loop_still_reports_what_its_steps_computed():
    # the events come from a copy of the loop: the same values here
    def f(c0):
        return jax.lax.scan(lambda c, x: (c * 0.5 + x, c), c0, jnp.arange(7.0))

    with tap.record(taps=[tap.on("mul")]) as rec:
        c, ys = sync(f(jnp.float32(1.0)))
    carries = [e.value for e in rec.events if e.kind == "carry"]
    prods = [e.value for e in rec.events if e.kind == "primitive"]
    assert float(carries[-1][0]) == float(c)
    np.testing.assert_array_equal(np.ravel(prods), np.asarray(ys) * 0.5)


def test_a_shadowed_loop_reports_before_the_loop_that_follows_it():
    def f(x):
        x, _ = jax.lax.scan(lambda c, t: (c * 0.9 + t, None), x, jnp.arange(4.0))  # short: shadowed
        x, _ = jax.lax.scan(lambda c, t: (c * 0.9 + jnp.sin(t), None), x, jnp.arange(200.0))
        return x

    with tap.record(select=lambda leaves: leaves[0]) as rec:
        out = sync(jax.jit(f)(jnp.float32(1.0)))
    assert_bits(jax.jit(f)(jnp.float32(1.0)), out)
    assert [e.path for e in rec.events] == ["scan[0]"] * 4 + ["scan[1]"] * 200


def test_the_users_own_prints_fire_once_in_a_shadowed_loop(capfd):
    def f(c0):
        def body(c, x):
            jax.debug.print("p{}", x)
            return c * 1.01 + jnp.sin(x), None
        return jax.lax.scan(body, c0, jnp.arange(3.0))[0]

    ref = sync(jax.jit(f)(jnp.float32(0.0)))
    capfd.readouterr()
    with tap.record(taps=[tap.on("sin")]) as rec:
        out = sync(jax.jit(f)(jnp.float32(0.0)))
    assert_bits(ref, out)
    assert capfd.readouterr().out.count("p") == 3
    assert len([e for e in rec.events if e.kind == "primitive"]) == 3


@pytest.mark.parametrize("n", [5, 100])
def test_gradients_through_a_shadowed_loop_are_the_users(n):
    def f(c0, xs):
        def body(c, x):
            return c * 1.01 + jnp.sin(x * c), None
        return jax.lax.scan(body, c0, xs)[0]

    xs = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
    grads = (jax.grad(f), jax.jit(jax.grad(f)), jax.jacfwd(f), jax.grad(jax.grad(f)))
    refs = [g(jnp.float32(0.2), xs) for g in grads]
    with tap.record(taps=[tap.on("mul")]) as rec:
        outs = [sync(g(jnp.float32(0.2), xs)) for g in grads]
    for ref, out in zip(refs, outs):
        assert_bits(ref, out)
    assert rec.events


@pytest.mark.parametrize("apart", [False, True])
def test_a_copy_that_rounds_apart_says_so_once(apart):
    # the mechanism, driven directly: a copy one ulp apart warns, an equal one does not
    from jaxtap import _rules

    def plain(x):
        return [x * 3.0]

    def copy(x):
        y = x * 3.0
        return [jnp.nextafter(y, jnp.inf) if apart else y]

    def f(x):
        return _rules.shadowed(copy, plain, [x])[0]

    with pytest.warns(UserWarning, match="rounded apart") if apart else _no_warning():
        out = sync(jax.jit(f)(jnp.arange(3.0)))
        jax.effects_barrier()
    assert_bits(jnp.arange(3.0) * 3.0, out)


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def cm():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    return cm()
