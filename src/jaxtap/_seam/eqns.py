"""The seam's vocabulary for equations: the primitives jax-tap rewrites,
their names, and the parameters it reads and writes.

Where JAX versions differ (scan's input split, the unified jaxpr type of
JAX >= 0.11), the accessors here answer in one vocabulary, so no other module
branches on the JAX version.
"""
from __future__ import annotations

import sys

import jax

from .versions import internal

__all__ = [
    "scan_p",
    "while_p",
    "cond_p",
    "jit_p",
    "remat_p",
    "custom_jvp_call_p",
    "custom_vjp_call_p",
    "closed_call_p",
    "hi_call_p",
    "SCAN",
    "WHILE",
    "COND",
    "JIT",
    "DEBUG_EFFECTS",
    "REMAT",
    "CUSTOM_JVP",
    "CUSTOM_VJP",
    "CLOSED_CALL",
    "HI_CALL",
    "LOOP_PRIMITIVES",
    "ClosedJaxpr",
    "Jaxpr",
    "Literal",
    "Var",
    "DropVar",
    "Tracer",
    "scan_parts",
    "scan_with_counter",
    "while_parts",
    "loop_body",
    "jit_body",
    "jit_with_body",
    "cond_branches",
    "cond_with_branches",
    "remat_body",
    "remat_with_body",
    "open_with_const_inputs",
    "call_body",
    "call_with_body",
    "subjaxprs_of",
    "impl_of",
    "impl_primitives",
    "impl_count",
    "top_loops",
    "scan_reverse",
    "TAP_SCOPE",
    "LOOP_SCOPE",
    "tap_scope",
    "loop_scope",
    "staged_by_us",
    "primitive_named",
    "is_leaf_float_eqn",
    "is_inexact",
    "is_plain_array",
    "bits_differ",
    "collect_names",
]

_hijax = internal("jax._src.hijax")
_pe = internal("jax._src.interpreters.partial_eval")
_core = internal("jax._src.core")

# ----------------------------------------------------------------- primitives
# From the modules jax.extend.core.primitives re-exports them from, not from
# jax.extend itself: importing jax.extend (JAX 0.12) imports Pallas, which
# registers config states, and a new config state changes every jit key: each
# function compiled before `import jaxtap` would compile once more.
_PRIMITIVE_MODULES = (
    "jax._src.ad_checkpoint", "jax._src.ad_util", "jax._src.core", "jax._src.custom_derivatives",
    "jax._src.dispatch", "jax._src.interpreters.ad", "jax._src.lax.lax", "jax._src.lax.special",
    "jax._src.lax.slicing", "jax._src.lax.convolution", "jax._src.lax.windowed_reductions",
    "jax._src.lax.control_flow", "jax._src.lax.fft", "jax._src.lax.parallel", "jax._src.lax.ann",
    "jax._src.lax.linalg", "jax._src.pjit", "jax._src.random.prng", "jax._src.random.threefry2x32",
    "jax._src.random.core", "jax._src.state.primitives",
)
_control_flow = internal("jax._src.lax.control_flow")
scan_p = _control_flow.scan_p
while_p = _control_flow.while_p
cond_p = _control_flow.cond_p
jit_p = internal("jax._src.pjit", "jit_p")
remat_p = internal("jax._src.ad_checkpoint", "remat_p")
custom_jvp_call_p = internal("jax._src.custom_derivatives", "custom_jvp_call_p")
custom_vjp_call_p = internal("jax._src.custom_derivatives", "custom_vjp_call_p")
closed_call_p = _core.closed_call_p  # JAX >= 0.11: the same primitive as eval_jaxpr
# A "hijax" primitive: a library operation (JAX >= 0.12: jnp.searchsorted,
# einsum, lax.custom_root, ...) that expands into ordinary equations, loops
# included, only when lowered. ``hi_expansion`` (staging) expands it.
hi_call_p = getattr(_hijax, "call_hi_primitive_p", None)

SCAN = scan_p.name  # "scan"
WHILE = while_p.name  # "while"
COND = cond_p.name
# the user's jax.debug.callback, jax.debug.print and
# jax.debug.inspect_array_sharding: effects without outputs
_debugging = internal("jax._src.debugging")
DEBUG_EFFECTS = frozenset(getattr(_debugging, p).name for p in ("debug_callback_p", "debug_print_p",
                                                                 "inspect_sharding_p") if hasattr(_debugging, p))
JIT = jit_p.name
REMAT = remat_p.name
CUSTOM_JVP = custom_jvp_call_p.name
CUSTOM_VJP = custom_vjp_call_p.name
CLOSED_CALL = closed_call_p.name
HI_CALL = None if hi_call_p is None else hi_call_p.name

LOOP_PRIMITIVES = (scan_p, while_p)

# JAX >= 0.11 has one jaxpr type (a Jaxpr may carry its consts, and
# ``.jaxpr`` is itself); ClosedJaxpr is an alias of it there.
ClosedJaxpr = getattr(_core, "ClosedJaxpr", _core.Jaxpr)
Jaxpr = _core.Jaxpr
Literal = _core.Literal
Var = _core.Var
DropVar = _core.DropVar
Tracer = jax.core.Tracer


# ------------------------------------------------------------ param access
# scan
# JAX <= 0.10 splits a scan's inputs by counts (num_consts, num_carry, and a
# per-input `linear`); JAX >= 0.11 by flat trees (ft_in = (consts, carry, xs),
# ft_out = (carry, ys)). The rest of jax-tap sees counts either way.
def _scan_uses_flat_trees(params) -> bool:
    return "ft_in" in params


def scan_parts(params):
    """(body, num_consts, num_carry, length) of a scan equation."""
    if _scan_uses_flat_trees(params):
        consts, carry, _ = params["ft_in"].unpack()
        return params["jaxpr"], len(consts), len(carry), params["length"]
    return params["jaxpr"], params["num_consts"], params["num_carry"], params["length"]


def scan_with_counter(params, new_body, extra_consts=0):
    """Scan params for a body that takes ``extra_consts`` more trailing
    consts and an extra leading int32 carry."""
    p = dict(params)
    p["jaxpr"] = new_body
    if _scan_uses_flat_trees(params):
        from jax._src import flattree as _ft
        consts, carry, xs = params["ft_in"].unpack()
        carry_out, ys = params["ft_out"].unpack()
        p["ft_in"] = _ft.pack(((consts, _ft.nones(extra_consts)), (_ft.nones(1), carry), xs))
        p["ft_out"] = _ft.pack(((_ft.nones(1), carry_out), ys))
        return p
    nc = params["num_consts"]
    p["num_consts"] = nc + extra_consts
    p["num_carry"] = params["num_carry"] + 1
    if "linear" in p and p["linear"] is not None:
        lin = tuple(p["linear"])
        p["linear"] = lin[:nc] + (False,) * (extra_consts + 1) + lin[nc:]
    return p


# while
def while_parts(params):
    return (params["cond_jaxpr"], params["cond_nconsts"],
            params["body_jaxpr"], params["body_nconsts"])


def loop_body(prim, params):
    """The body jaxpr of a loop equation (a scan's or a while loop's)."""
    return params["jaxpr"] if prim is scan_p else params["body_jaxpr"]


# jit
def jit_body(params):
    return params["jaxpr"]


def jit_with_body(params, new_body, extra_inputs=0, extra_outputs=0):
    """jit params for a new body with extra trailing inputs/outputs; every
    other parameter is kept as it was."""
    p = dict(params)
    p["jaxpr"] = new_body
    if extra_inputs or extra_outputs:
        from jax._src.pjit import UNSPECIFIED
    if extra_inputs:
        p["in_shardings"] = tuple(p["in_shardings"]) + (UNSPECIFIED,) * extra_inputs
        p["in_layouts"] = tuple(p["in_layouts"]) + (None,) * extra_inputs
        p["donated_invars"] = tuple(p["donated_invars"]) + (False,) * extra_inputs
    if extra_outputs:
        p["out_shardings"] = tuple(p["out_shardings"]) + (UNSPECIFIED,) * extra_outputs
        p["out_layouts"] = tuple(p["out_layouts"]) + (None,) * extra_outputs
    return p


# cond
def cond_branches(params):
    return params["branches"]


def cond_with_branches(params, branches):
    p = dict(params)
    p["branches"] = tuple(branches)
    return p


# remat (jax.checkpoint): an open jaxpr (JAX <= 0.10), or one that may carry
# its consts (JAX >= 0.11)
def remat_body(params):
    body = params["jaxpr"]
    return body if isinstance(body, ClosedJaxpr) else ClosedJaxpr(body, ())


def remat_with_body(params, closed):
    """remat params for a closed body; returns (params, leading const args)."""
    p = dict(params)
    jaxpr, consts = open_with_const_inputs(closed)
    p["jaxpr"] = jaxpr
    return p, consts


# custom_jvp_call / custom_vjp_call / closed_call
def open_with_const_inputs(closed):
    """An open jaxpr whose leading inputs are `closed`'s consts."""
    if not closed.consts:
        return closed.jaxpr, []
    return _pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def call_body(params):
    return params["call_jaxpr"]


def call_with_body(params, body):
    p = dict(params)
    p["call_jaxpr"] = body
    return p


def subjaxprs_of(params, eqn=None) -> list:
    """Every jaxpr held in an equation's params (for discovery walks),
    including the expansion of a hijax primitive and, given the equation,
    of a library primitive that lowers by tracing its implementation."""
    def opened(x):
        return x.jaxpr if isinstance(x, ClosedJaxpr) else x

    out = []
    for v in params.values():
        if isinstance(v, (ClosedJaxpr, Jaxpr)):
            out.append(opened(v))
        elif isinstance(v, (tuple, list)):
            out.extend(opened(x) for x in v if isinstance(x, (ClosedJaxpr, Jaxpr)))
    if "_prim" in params and hi_call_p is not None:
        from .staging import hi_expansion
        expanded = hi_expansion(params)
        if expanded is not None:
            out.append(expanded.jaxpr)
    if eqn is not None and impl_of(eqn.primitive) is not None:
        from .staging import impl_expansion
        expanded = impl_expansion(eqn.primitive, params, [v.aval for v in eqn.invars], eqn)
        if expanded is not None:
            out.append(expanded.jaxpr)
    return out


# Library primitives whose lowering traces a Python implementation, so their
# loops exist only when the program is lowered: Equinox's ``create_vprim``
# (lineax's ``linear_solve``). The walker expands them; their derivative and
# batching rules stay theirs.
_EQX_PRIMITIVE = "equinox.internal._primitive"


def _impl_registry() -> dict:
    module = sys.modules.get(_EQX_PRIMITIVE)  # never imported by us: only if the user has
    registry = getattr(module, "_vprim_impl_registry", None)
    return registry if isinstance(registry, dict) else {}


def impl_of(prim):
    """The implementation such a primitive lowers to, or None."""
    try:
        return _impl_registry().get(prim)
    except TypeError:  # an unhashable primitive
        return None


def impl_primitives() -> list:
    return list(_impl_registry())


def impl_count() -> int:
    """How many such primitives exist now (checked before each jit trace in a block: no list built)."""
    return len(_impl_registry())


def top_loops(jaxpr):
    """(name, site) of each loop reachable without entering a loop body, in
    program order (through jits, branches and other calls)."""
    from .stack import loop_site, site_of_eqn
    for eqn in jaxpr.eqns:
        if eqn.primitive in LOOP_PRIMITIVES:
            yield ("scan" if eqn.primitive is scan_p else "while"), loop_site(eqn.primitive, eqn.params,
                                                                              site_of_eqn(eqn))
        else:
            for sub in subjaxprs_of(eqn.params, eqn):
                yield from top_loops(sub)


def scan_reverse(params) -> bool:
    return bool(params["reverse"])


# Equations jax-tap stages carry these names in their name stack, so a walk
# that meets a program an earlier interception already tapped (a jit cache
# hit) recognizes them: stale emissions are dropped, tapped loops kept whole.
TAP_SCOPE = "jaxtap_tap"
LOOP_SCOPE = "jaxtap_loop"


def tap_scope():
    return jax.named_scope(TAP_SCOPE)


def loop_scope():
    return jax.named_scope(LOOP_SCOPE)


def staged_by_us(eqn):
    """None, "tap" (an emission) or "loop" (a loop jax-tap rewrote)."""
    names = str(eqn.source_info.name_stack)
    if TAP_SCOPE in names:
        return "tap"
    if LOOP_SCOPE in names:
        return "loop"
    return None


def _primitive_table():
    table = {}
    for module in _PRIMITIVE_MODULES:
        mod = internal(module)
        for attr in dir(mod) if mod is not None else ():
            prim = getattr(mod, attr)
            if attr.endswith("_p") and isinstance(prim, _core.Primitive):
                table.setdefault(prim.name, prim)
    return table
_PRIMS_BY_NAME = None


def primitive_named(name):
    """The Primitive object called ``name`` (None when JAX exposes none)."""
    global _PRIMS_BY_NAME
    if _PRIMS_BY_NAME is None:
        _PRIMS_BY_NAME = _primitive_table()
    return _PRIMS_BY_NAME.get(name)


def is_leaf_float_eqn(eqn) -> bool:
    """A primitive (no sub-jaxprs) with a floating-point or complex output."""
    if subjaxprs_of(eqn.params):
        return False
    return any(is_inexact(getattr(v.aval, "dtype", None)) for v in eqn.outvars)


def is_inexact(dtype) -> bool:
    try:
        return dtype is not None and bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))
    except TypeError:  # extended dtypes (PRNG keys) are never NaN
        return False


def is_plain_array(x) -> bool:
    """An array of numbers or bools (no PRNG key, no float0): one an
    optimization barrier takes as it is."""
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and (bool(jax.numpy.issubdtype(dtype, jax.numpy.number)) or dtype == bool)
    except TypeError:
        return False


def bits_differ(pairs):
    """Traced: do any of the ``(a, b)`` array pairs differ bit for bit?
    (None for no pairs.) Floats compare as their bits: NaN equals NaN."""
    flags = []
    for a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            continue
        if jax.numpy.issubdtype(a.dtype, jax.numpy.complexfloating):
            a, b = jax.numpy.stack([a.real, a.imag]), jax.numpy.stack([b.real, b.imag])
        if jax.numpy.issubdtype(a.dtype, jax.numpy.floating):
            width = {2: jax.numpy.uint16, 4: jax.numpy.uint32, 8: jax.numpy.uint64}.get(a.dtype.itemsize)
            if width is None:
                continue
            a, b = jax.lax.bitcast_convert_type(a, width), jax.lax.bitcast_convert_type(b, width)
        flags.append(jax.numpy.any(a != b))
    if not flags:
        return None
    out = flags[0]
    for f in flags[1:]:
        out = out | f
    return out


# jax-tap's own primitives (.callback): never a name the user's program has
HOP_NAME, BYTES_NAME = "jaxtap_callback", "jaxtap_bytes"
OWN_PRIMITIVE_NAMES = frozenset((HOP_NAME, BYTES_NAME))


def collect_names(jaxpr, out=None, into=None) -> dict:
    """Primitive name -> count, including the jaxprs nested in equations
    named in ``into`` (every nested jaxpr when None) and the expansions of
    primitives that lower by tracing their implementation."""
    out = {} if out is None else out
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        # a program traced in a block holds our loops and hops: not the user's
        if name not in OWN_PRIMITIVE_NAMES and staged_by_us(eqn) is None:
            out[name] = out.get(name, 0) + 1
        if into is None or name in into or impl_of(eqn.primitive) is not None:
            for sub in subjaxprs_of(eqn.params, eqn):
                collect_names(sub, out, into)
    return out
