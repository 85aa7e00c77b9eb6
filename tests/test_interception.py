"""What the with-form intercepts: the loops the user's code asks for, never
loops JAX binds into derivative code, nor loops jax-tap staged itself."""
import collections

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from taputil import assert_bits, sync

import jaxtap as tap


@jax.custom_jvp
def _smooth(x):
    return jnp.sin(x)


@_smooth.defjvp
def _smooth_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # the rule runs a loop on the tangent: derivative code JAX will transpose
    dt = lax.scan(lambda c, _: (c * 0.5, None), t * jnp.cos(x), None, length=3)[0]
    return jnp.sin(x), dt


def _lin(v):
    return lax.scan(lambda c, _: (c * 0.5 + c[::-1], None), v, None, length=3)[0]


def _gmres_loss(b):
    def matvec(v):
        return lax.fori_loop(0, 2, lambda i, u: u * 0.9 + 0.1 * jnp.roll(u, 1), v) + v
    return jax.scipy.sparse.linalg.gmres(matvec, b)[0].sum()


CASES = {
    "grad of a custom_jvp whose rule loops": (lambda: jax.grad(lambda x: _smooth(x).sum())(jnp.arange(3.0))),
    "linear_transpose of a scan": (lambda: jax.linear_transpose(_lin, jnp.ones(3))(jnp.arange(3.0))),
    "grad through gmres with a looping matvec": (lambda: jax.grad(_gmres_loss)(jnp.array([1.0, 2.0, 3.0]))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_derivative_code_is_never_rewritten(name):
    want = sync(CASES[name]())
    with tap.record(flush_every=4):
        got = sync(CASES[name]())
    assert_bits(got, want)


def test_a_wrapped_function_in_a_loop_body_is_not_tapped_twice():
    inner = tap.verbose(lambda c: lax.scan(lambda d, _: (d * 0.9 + 0.1, None), c, None, length=3)[0],
                        on_step=lambda e: None)

    def f(x):
        return lax.scan(lambda c, _: (inner(c) + 0.01, None), x, None, length=2)[0]

    with tap.record() as rec:
        out = sync(jax.jit(f)(jnp.float32(0.3)))
    assert_bits(out, jax.jit(f)(jnp.float32(0.3)))
    paths = {e.path for e in rec.events}
    assert not any("while" in p for p in paths), paths  # jax-tap's own driver loops stay invisible


def test_loops_inside_library_code_get_their_own_addresses():
    """expm runs two different scans from one user line: two addresses, the
    same in both forms."""
    f = lambda a: jax.scipy.linalg.expm(a)  # noqa: E731
    a = jnp.eye(3, dtype=jnp.float32) * 0.3
    wrapped = []
    sync(tap.verbose(f, on_step=wrapped.append)(a))
    with tap.record() as rec:
        sync(f(a))
    for events in (wrapped, rec.events):
        shapes = collections.defaultdict(set)
        for e in events:
            shapes[e.path].add((e.total, tuple(getattr(v, "shape", ()) for v in e.value)))
        assert len(shapes) == 2 and all(len(s) == 1 for s in shapes.values()), dict(shapes)
    assert [(e.path, e.step) for e in wrapped] == [(e.path, e.step) for e in rec.events]
