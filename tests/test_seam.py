"""The jax-internals seam: every assumption jax-tap makes about JAX's
internals, checked directly, so a JAX upgrade that breaks one fails here
loudly (and names it) instead of somewhere deep in a tapped program."""
import jax
import jax.numpy as jnp

import jaxtap as tap
from jaxtap import _seam
from jaxtap._seam import stack as _stack


def test_primitive_names_we_rewrite():
    assert (_seam.SCAN, _seam.WHILE, _seam.COND, _seam.JIT) == ("scan", "while", "cond", "jit")
    assert _seam.REMAT == "remat2"
    assert (_seam.CUSTOM_JVP, _seam.CUSTOM_VJP) == ("custom_jvp_call", "custom_vjp_call")


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
        seen.append(_stack._in_derivative_code())
        return jnp.sin(primals[0]), tangents[0] * jnp.cos(primals[0])

    jax.grad(f)(1.0)
    assert seen and any(seen)
    assert not _stack._in_derivative_code()
