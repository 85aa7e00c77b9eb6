"""`tap.watch_nan()` with no name: where was the first NaN born?"""
import jax
import numpy as np
import jax.numpy as jnp

import jaxtap as tap
from taputil import assert_bits, sync


def three_deep(x0, xs):
    def outer(c, x):
        def mid(cc, t):
            def inner(s):
                i, v = s
                return i + 1, jnp.sqrt(v - 0.5 * t) + v * 0.1  # negative under the root when v < t/2
            _, v = jax.lax.while_loop(lambda s: s[0] < 2, inner, (0, cc))
            return v * 0.9 + x, None
        c2, _ = jax.lax.scan(mid, c, jnp.linspace(0.0, 3.0, 4))
        return c2 * 1.1, c2
    return jax.lax.scan(outer, x0, xs)


ARGS = (jnp.float32(2.0), jnp.array([1.0, 1.0, 0.1, 1.0], jnp.float32))
BORN = "[tap] FAIL scan[0]/scan[0]/while[0]/sqrt[0] 1/?: NaN/Inf born here (inputs finite)"


def lines(text):
    return [x for x in text.splitlines() if x.startswith("[tap]")]


def test_birth_site_three_loops_deep_is_reported_once(capfd):
    expected = three_deep(*ARGS)
    with tap.record(taps=[tap.watch_nan()]) as rec:
        out = sync(three_deep(*ARGS))
    assert_bits(out, expected)
    assert lines(capfd.readouterr().err) == [BORN]
    births = [e for e in rec.events if e.kind == "primitive"]
    assert len(births) >= 1 and births[0].path == "scan[0]/scan[0]/while[0]/sqrt[0]"


def test_propagation_is_not_a_birth(capfd):
    # without once, the NaN propagating outward (add, mul, the outer loops) reports nothing more
    sync(tap.verbose(three_deep, taps=[tap.watch_nan(once=False)])(*ARGS))
    assert lines(capfd.readouterr().err) == [BORN]


def test_named_watch_sees_every_non_finite_output_birth_sees_the_first(capfd):
    with tap.record(taps=[tap.watch_nan("sqrt")]):
        sync(three_deep(*ARGS))
    named = lines(capfd.readouterr().err)
    assert len(named) > 1 and all(x.endswith(": NaN/Inf") for x in named)


def test_finite_program_is_silent_and_identical(capfd):
    args = (jnp.float32(9.0), jnp.array([5.0, 5.0], jnp.float32))
    expected = three_deep(*args)
    assert all(bool(jnp.isfinite(v).all()) for v in jax.tree.leaves(expected))
    out = sync(jax.jit(tap.verbose(three_deep, taps=[tap.watch_nan()]))(*args))
    assert_bits(out, expected)
    assert lines(capfd.readouterr().err) == []


def test_nan_of_the_backward_pass_is_found_in_the_backward_loop_in_both_forms(capfd):
    """d/dx sqrt at 0 is 1/0: the forward pass is finite, the backward loop
    JAX builds turns it into NaN. Tapping the differentiated function (either
    form) watches that loop; it counts the forward steps down."""
    def loss(x):
        def body(c, t):
            return c + jnp.sqrt(c**2 + (x * t) ** 2), None  # d/dx sqrt at 0 is 0/0
        return jax.lax.scan(body, jnp.float32(0.0), jnp.array([0.0, 1.0]))[0]

    sync(tap.verbose(loss, taps=[tap.watch_nan()])(jnp.float32(0.0)))
    assert lines(capfd.readouterr().err) == []  # forward is finite
    seen = []
    g = tap.verbose(jax.grad(loss), on_step=seen.append, taps=[tap.watch_nan("mul", once=True)])
    assert np.isnan(sync(g(jnp.float32(0.0))))
    found = lines(capfd.readouterr().err)
    assert found and all(x.startswith("[tap] FAIL scan[1]/mul[") and " 0/2: " in x for x in found)
    with tap.record(taps=[tap.watch_nan("mul", once=True)]) as rec:
        sync(jax.grad(loss)(jnp.float32(0.0)))
    assert lines(capfd.readouterr().err) == found
    assert [(e.path, e.step) for e in rec.events] == [(e.path, e.step) for e in seen]


def test_birth_watch_with_prng_key_carry(capfd):
    def f(key, x):
        def body(c, _):
            k, v = c
            k, sub = jax.random.split(k)
            return (k, jnp.log(v - 1.0 + jax.random.uniform(sub) * 0.0)), None
        return jax.lax.scan(body, (key, x), None, length=3)

    seen = []
    with tap.record(taps=[tap.watch_nan()], on_step=seen.append):
        sync(f(jax.random.key(0), jnp.float32(2.5)))
    assert [e.kind for e in seen].count("carry") == 3 and [e.kind for e in seen].count("primitive") == 1
    found = lines(capfd.readouterr().err)
    assert len(found) == 1 and found[0].startswith("[tap] FAIL scan[0]/log[0] ") and "born here" in found[0]
