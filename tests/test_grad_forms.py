"""The with-form around every way of differentiating: bitwise results, the
forward loop and its backward twin reported once each, buffered or not."""
import collections

import jax
import jax.numpy as jnp
import pytest
from taputil import assert_bits, cases, sync

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


# ------------------------------------------------ the user's own debug callbacks
SEEN = []


def _noisy(x):
    """Loops whose bodies call jax.debug.callback: in a scan, in a cond
    inside it, in a jit inside a while loop (nested under the scan)."""
    def inner(c):
        jax.debug.callback(lambda v: SEEN.append(("while", float(v))), c[1])
        return c[0] + 1, c[1] * 0.9

    def body(c, t):
        jax.debug.callback(lambda v: SEEN.append(("scan", float(v))), c)
        c = jax.lax.cond(t > 1.0, _loud_branch, lambda v: v * 1.0, c)
        # (a while loop is not reverse-differentiable: its input is not differentiated)
        w = jax.lax.while_loop(lambda s: s[0] < 2, jax.jit(inner), (0, jax.lax.stop_gradient(c)))[1]
        return c * 1.01 + jnp.sin(t * w), jnp.cos(c)

    c, ys = jax.lax.scan(body, x, jnp.arange(3.0, dtype=jnp.float32))
    return c + ys.sum()


def _loud_branch(v):
    jax.debug.print("branch {v}", v=v)
    return v * 1.0


NOISY = {
    "grad": lambda: jax.grad(_noisy)(X),
    "jit(grad)": lambda: jax.jit(jax.grad(_noisy))(X),
    "grad(jit)": lambda: jax.grad(jax.jit(_noisy))(X),
    "value_and_grad": lambda: jax.value_and_grad(_noisy)(X),
    "jvp": lambda: jax.jvp(_noisy, (X,), (jnp.float32(1.0),)),
    "grad(checkpoint)": lambda: jax.grad(jax.checkpoint(_noisy))(X),
    "vmap(grad)": lambda: jax.vmap(jax.grad(_noisy))(jnp.stack([X, X + 1])),
}


@pytest.mark.parametrize("form", sorted(NOISY))
def test_the_users_debug_callbacks_fire_as_often_as_untapped(form, capfd):
    """Under differentiation the events come from a second run of the loop
    beside the one JAX differentiates: the user's jax.debug.callback and
    jax.debug.print fire in the latter only, as often as untapped."""
    SEEN.clear()
    want = sync(NOISY[form]())
    plain, plain_out = sorted(SEEN), capfd.readouterr().out
    SEEN.clear()
    with tap.record() as rec:
        got = sync(NOISY[form]())
    assert_bits(got, want)
    assert sorted(SEEN) == plain and plain
    assert sorted(capfd.readouterr().out.splitlines()) == sorted(plain_out.splitlines()) and plain_out
    assert {"scan[0]", "scan[0]/while[0]"} <= {e.path for e in rec.events}  # the events still came


@jax.jit
def _below(v):  # a jitted helper of the cond: its callback is the user's too
    jax.debug.callback(lambda u: SEEN.append(("helper", float(u))), v)
    return v < 30.0


@jax.custom_jvp
def _positive(v):  # a custom_jvp function of the cond, and a checkpointed one: theirs too
    jax.debug.callback(lambda u: SEEN.append(("custom_jvp", float(u))), v)
    return v > -1.0


_positive.defjvp(lambda p, t: (_positive(p[0]), jnp.zeros((), jax.dtypes.float0)))


@jax.checkpoint
def _finite(v):
    jax.debug.callback(lambda u: SEEN.append(("checkpoint", float(u))), v)
    return jnp.isfinite(v)


def _grow(x):
    """A while loop whose cond_fun prints (a data-dependent trip count: XLA
    keeps the cond's side effects only then)."""
    def cond(c):
        jax.debug.callback(lambda u: SEEN.append(("cond", float(u))), c[1])
        return _below(c[1]) & _positive(c[1]) & _finite(c[1])
    return jax.lax.while_loop(cond, lambda c: (c[0] + 1, c[1] * 1.5 + 1.0), (0, x))[1]


def _grown_in_a_scan(x):
    return jax.lax.scan(lambda c, _: (_grow(c) - 29.0, None), x, None, length=3)[0]


GROWN = {
    "jit": lambda: jax.jit(_grow)(X),
    "eager": lambda: _grow(X),
    "in a scan": lambda: jax.jit(_grown_in_a_scan)(X),
    "jvp": lambda: jax.jit(lambda x: jax.jvp(_grow, (x,), (jnp.float32(1.0),)))(X),
    "jvp of a scan": lambda: jax.jit(lambda x: jax.jvp(_grown_in_a_scan, (x,), (jnp.float32(1.0),)))(X),
    "vmap": lambda: jax.jit(jax.vmap(_grow))(jnp.stack([X, X + 1])),
}
COND_GAPS = {"vmap": "vmap batches the runner's cond into its body too: the cond fires 3 times per step, "
                     "untapped 2 (README: Known limitations)"}


@pytest.mark.parametrize("options", [{}, {"sample_every": 3}, {"flush_every": 4}, {"max_depth": 0}],
                         ids=["every step", "every 3", "buffered", "outermost only"])
@pytest.mark.parametrize("form", list(cases({name: COND_GAPS.get(name) for name in GROWN})))
def test_a_while_conds_debug_callbacks_fire_as_often_as_untapped(form, options):
    """The runner and the driver evaluate a while loop's cond more often than
    the untapped loop: the user's debug callbacks in cond_fun (and in a jit
    it calls) still fire once per state, with the same values."""
    SEEN.clear()
    want = sync(GROWN[form]())
    plain = sorted(SEEN)
    SEEN.clear()
    with tap.record(**options) as rec:
        got = sync(GROWN[form]())
    assert_bits(got, want)
    assert len(rec) and plain and {tag for tag, _ in plain} == {"cond", "helper", "custom_jvp", "checkpoint"}
    assert sorted(SEEN) == plain


# ------------------------------------------ loops inside custom_vjp / custom_jvp
@jax.custom_vjp
def fixed_point(a):
    return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.cos(c[1]) * a), (0, a))[1]


def _fp_fwd(a):
    y = fixed_point(a)
    return y, (a, y)


def _fp_bwd(res, g):
    a, y = res
    return (g * jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5 + y, a),)


fixed_point.defvjp(_fp_fwd, _fp_bwd)


@jax.custom_jvp
def powered(a):
    return jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] * a), (0, a))[1]


powered.defjvp(lambda p, t: (powered(p[0]), t[0] * 2.0))

CUSTOM = {
    "custom_vjp-grad": (fixed_point, jax.grad, None),
    "custom_vjp-grad2": (fixed_point, lambda f: jax.grad(jax.grad(f)), None),
    "custom_vjp-checkpoint": (fixed_point, lambda f: jax.grad(jax.checkpoint(f)), None),
    "custom_vjp-vmap_grad": (fixed_point, lambda f: jax.vmap(jax.grad(f)), None),
    "custom_jvp-grad": (powered, jax.grad, None),
    "custom_jvp-grad2": (powered, lambda f: jax.grad(jax.grad(f)), None),
    "custom_jvp-jacfwd": (powered, jax.jacfwd, None),
    "custom_jvp-checkpoint": (powered, lambda f: jax.grad(jax.checkpoint(f)), None),
    "custom_jvp-vmap_grad": (powered, lambda f: jax.vmap(jax.grad(f)), None),
}


@pytest.mark.parametrize("name", list(cases({name: gap for name, (_, _, gap) in CUSTOM.items()})))
def test_loops_in_custom_rules_emit_under_autodiff_in_both_forms(name):
    fn, transform, _ = CUSTOM[name]
    g = transform(fn)
    x = jnp.full(3, 0.7, jnp.float32) if "vmap" in name else jnp.float32(0.7)
    want = sync(g(x))
    seen = []
    got_v = sync(tap.verbose(g, on_step=seen.append, select=lambda leaves: ())(x))
    with tap.record(select=lambda leaves: ()) as rec:
        got_w = sync(g(x))
    assert_bits(got_v, want)
    assert_bits(got_w, want)
    paths_v = collections.Counter(e.path for e in seen)
    paths_w = collections.Counter(e.path for e in rec.events)
    assert paths_v["while[0]"] > 0  # the loop inside the custom rule is heard under autodiff
    assert paths_v == paths_w


# Tangent code: a custom_jvp rule (JAX traces it with the tangents as inputs,
# then transposes the tangent part) and a function given to linear_transpose
# (transposed whole). A primitive tap there, also inside a jit those call,
# must neither reach the transposition (a NaN tripwire's cond on a tangent
# cannot be transposed; a hop's packing could not be either) nor change bits.
C = jnp.float32(3.0)
TANGENT_CODE = {
    "grad(softplus)": lambda: jax.grad(lambda x: jax.nn.softplus(x * 2.0).sum())(jnp.linspace(-1, 2, 5)),
    "grad(scan of softplus)": lambda: jax.grad(lambda x: jax.lax.scan(
        lambda c, _: (jax.nn.softplus(c) * 0.9, None), x, None, length=3)[0].sum())(jnp.linspace(-1, 2, 5)),
    "jit(grad(norm))": lambda: jax.jit(jax.grad(lambda x: jnp.linalg.norm(x * 3.0)))(jnp.linspace(-1, 2, 5)),
    "linear_transpose": lambda: jax.linear_transpose(lambda t: t * C, X)(X),
    "jit(linear_transpose)": lambda: jax.jit(lambda x: jax.linear_transpose(lambda t: t * C, x)(x))(X),
    "linear_transpose(scan)": lambda: jax.linear_transpose(
        lambda t: jax.lax.scan(lambda s, _: (s * C, None), t, None, length=3)[0], X)(X),
}


@pytest.mark.parametrize("kind", ["on", "watch_nan", "print"])
@pytest.mark.parametrize("form", sorted(TANGENT_CODE))
def test_primitive_taps_in_tangent_code(form, kind, capfd):
    want = sync(TANGENT_CODE[form]())
    with tap.record(taps=[getattr(tap, kind)("mul")]):
        got = sync(TANGENT_CODE[form]())
    assert_bits(got, want)


@jax.custom_vjp
def _halve_until_small(x):
    return jax.lax.while_loop(lambda c: c > 1.0, lambda c: c * 0.5, x)


_halve_until_small.defvjp(lambda x: (_halve_until_small(x), None), lambda _, g: (g,))


@pytest.mark.parametrize("order", ["custom first", "custom second"])
def test_where_sees_the_final_address_of_a_loop_in_a_custom_body(order):
    # a custom_vjp body's loop is numbered when its events arrive (Equinox's
    # checkpointed while_loop, diffrax's solver loop, is such a body); a
    # `where` written from the events' paths must select it
    def f(x):
        plain = lambda v: jax.lax.while_loop(lambda c: c < 100.0, lambda c: c * 3.0, v)  # noqa: E731
        if order == "custom first":
            return plain(_halve_until_small(x * 40.0))
        return _halve_until_small(plain(x) * 2.0)

    g = jax.jit(f)
    want = sync(g(X))
    with tap.record() as rec:
        sync(g(X))
    by_path = collections.Counter(e.path for e in rec.events)
    assert set(by_path) == {"while[0]", "while[1]"}
    for path in by_path:
        with tap.record(where=lambda p, path=path: p == path) as only:
            got = sync(g(X))
        assert_bits(got, want)
        assert collections.Counter(e.path for e in only.events) == {path: by_path[path]}


@jax.custom_vjp
def _scan_in_custom(x):
    return jax.lax.scan(lambda c, _: (c * 0.5, c), x, None, length=2)


_scan_in_custom.defvjp(lambda x: (_scan_in_custom(x), None), lambda _, g: (g[0],))


def test_where_in_a_custom_body_filters_outputs_and_still_checks_itself():
    f = jax.jit(lambda x: _scan_in_custom(jax.lax.scan(lambda c, _: (c + 1.0, c), x, None, length=2)[0]))
    with tap.record(select_ys=lambda ys: ys) as rec:
        sync(f(X))
    assert {(e.path, e.kind) for e in rec.events} == {(p, k) for p in ("scan[0]", "scan[1]")
                                                      for k in ("carry", "output")}
    for path in ("scan[0]", "scan[1]"):
        with tap.record(select_ys=lambda ys: ys, where=lambda p, path=path: p == path) as only:
            sync(f(X))
        assert {(e.path, e.kind) for e in only.events} == {(path, "carry"), (path, "output")}
    with pytest.raises(tap.TapSelectError, match="where"):
        with tap.record(where=lambda: True):  # no argument: bad input, also for a body's loop
            sync(jax.jit(lambda x: _scan_in_custom(x))(X))
