"""The with-form around every way of differentiating: bitwise results, the
forward loop and its backward twin reported once each, buffered or not."""
import collections

import jax
import jax.numpy as jnp
import pytest
from taputil import assert_bits, sync

import jaxtap as tap


def loss(x):
    def body(c, t):
        return c * 1.01 + jnp.sin(t * c), jnp.cos(c)
    c, ys = jax.lax.scan(body, x, jnp.arange(5.0, dtype=jnp.float32))
    return c + ys.sum()


X = jnp.float32(0.3)
FORMS = {
    "grad": lambda: jax.grad(loss)(X),
    "grad(jit)": lambda: jax.grad(jax.jit(loss))(X),
    "jit(grad(jit))": lambda: jax.jit(jax.grad(jax.jit(loss)))(X),
    "vjp(jit)": lambda: jax.vjp(jax.jit(loss), X)[1](jnp.float32(1.0)),
    "grad(checkpoint)": lambda: jax.grad(jax.checkpoint(loss))(X),
    "value_and_grad": lambda: jax.value_and_grad(loss)(X),
    "jvp(jit)": lambda: jax.jvp(jax.jit(loss), (X,), (jnp.float32(1.0),)),
    "hessian": lambda: jax.hessian(loss)(X),
}


@pytest.mark.parametrize("flush_every", [None, 3])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_with_form_around_differentiation(form, flush_every):
    want = sync(FORMS[form]())
    with tap.record(flush_every=flush_every, taps=[tap.on("sin")]) as rec:
        got = sync(FORMS[form]())
    assert_bits(got, want)
    loops = collections.Counter(e.path for e in rec.events if e.kind == "carry")
    assert loops["scan[0]"] >= 5 and loops["scan[0]"] % 5 == 0  # the forward loop, once per evaluation
    assert set(loops) <= {"scan[0]", "scan[1]"}  # plus, in reverse mode, its backward twin
    if form in ("grad", "grad(jit)", "jit(grad(jit))", "vjp(jit)", "value_and_grad"):
        assert loops == {"scan[0]": 5, "scan[1]": 5}
