"""The jax-internals seam.

Every use of ``jax._src``, every primitive name and every equation parameter
name that jax-tap depends on lives in this module, so that a JAX upgrade
touches one file. ``tests/test_seam.py`` fails loudly when one of these
assumptions stops holding.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import jax.extend as jex
import numpy as np
from jax._src import config as _config
from jax._src import core as _core
from jax._src import source_info_util as _source_info
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import partial_eval as _pe

# ----------------------------------------------------------------- primitives
_P = jex.core.primitives
scan_p = _P.scan_p
while_p = _P.while_p
cond_p = _P.cond_p
jit_p = _P.jit_p
remat_p = _P.remat_p
custom_jvp_call_p = _P.custom_jvp_call_p
custom_vjp_call_p = _P.custom_vjp_call_p
closed_call_p = _P.closed_call_p

SCAN = scan_p.name  # "scan"
WHILE = while_p.name  # "while"
COND = cond_p.name
JIT = jit_p.name
REMAT = remat_p.name
CUSTOM_JVP = custom_jvp_call_p.name
CUSTOM_VJP = custom_vjp_call_p.name
CLOSED_CALL = closed_call_p.name

LOOP_PRIMITIVES = (scan_p, while_p)

ClosedJaxpr = jex.core.ClosedJaxpr
Jaxpr = jex.core.Jaxpr
Literal = jex.core.Literal
Var = jex.core.Var
DropVar = jex.core.DropVar
Tracer = _core.Tracer

# Hide our own frames from JAX's source info and filtered tracebacks, so
# that an equation's "user frame" is the user's line, never ours.
_HERE = os.path.dirname(os.path.abspath(__file__))
_source_info.register_exclusion(_HERE)
_traceback_util.register_exclusion(_HERE)

# ------------------------------------------------------------ param access
# scan
def scan_parts(params):
    """(body, num_consts, num_carry, length) of a scan equation."""
    return params["jaxpr"], params["num_consts"], params["num_carry"], params["length"]


def scan_with_counter(params, new_body, extra_consts=0):
    """Scan params for a body that takes ``extra_consts`` more trailing
    consts and an extra leading int32 carry."""
    p = dict(params)
    nc = params["num_consts"]
    p["jaxpr"] = new_body
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


def while_with_counter(params, new_cond, new_body):
    p = dict(params)
    p["cond_jaxpr"] = new_cond
    p["body_jaxpr"] = new_body
    return p


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


# remat (jax.checkpoint): an open jaxpr
def remat_body(params):
    return ClosedJaxpr(params["jaxpr"], ())


def remat_with_body(params, closed):
    """remat params for a closed body; returns (params, leading const args)."""
    p = dict(params)
    jaxpr, consts = open_with_const_inputs(closed)
    p["jaxpr"] = jaxpr
    return p, consts


# custom_jvp_call / custom_vjp_call / closed_call
def call_body(params):
    return params["call_jaxpr"]


def call_with_body(params, body):
    p = dict(params)
    p["call_jaxpr"] = body
    return p


def subjaxprs_of(params) -> list:
    """Every jaxpr held in an equation's params (for discovery walks)."""
    out = []
    for v in params.values():
        if isinstance(v, ClosedJaxpr):
            out.append(v.jaxpr)
        elif isinstance(v, Jaxpr):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                if isinstance(x, ClosedJaxpr):
                    out.append(x.jaxpr)
                elif isinstance(x, Jaxpr):
                    out.append(x)
    return out


# ------------------------------------------------------------ jaxpr tools
def open_with_const_inputs(closed):
    """An open jaxpr whose leading inputs are `closed`'s consts."""
    if not closed.consts:
        return closed.jaxpr, []
    return _pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def trace_closed(fn: Callable, in_avals: Sequence[Any]) -> ClosedJaxpr:
    """Trace ``fn(*flat_args) -> list`` over abstract values to a ClosedJaxpr."""
    specs = [spec_of(a) for a in in_avals]
    closed = jax.make_jaxpr(lambda *a: list(fn(*a)))(*specs)
    return closed


def spec_of(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def eval_eqn(eqn, invals):
    """Bind one equation exactly as ``jax.core.eval_jaxpr`` does."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def bind_with_params(eqn, prim, invals, params):
    """Bind ``prim`` with new params under ``eqn``'s source info and context."""
    bind_params = prim.get_bind_params(params)
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        ans = type(prim).bind(prim, *invals, **bind_params)
    return list(ans) if prim.multiple_results else [ans]


def bind_original(prim, args, params):
    """The class-level bind, bypassing any instance-level interception."""
    return type(prim).bind(prim, *args, **params)


eval_jaxpr = _core.eval_jaxpr


def while_loop(cond_fun, body_fun, init):
    """``lax.while_loop`` over a tuple carry, marked as ours (LOOP_SCOPE): a
    with-block that later walks a program holding it never taps it again."""
    with loop_scope():
        return jax.lax.while_loop(cond_fun, lambda s: tuple(body_fun(s)), tuple(init))


def scan_reverse(params) -> bool:
    return bool(params["reverse"])


def empty_stack(length, aval):
    """The ys buffer ``scan``'s own lowering starts from."""
    from jax._src.lax.control_flow import loops as _loops
    return _loops._empty_array((length,), (None,), aval)


def empty_like(aval):
    """An (unspecified) array of ``aval``'s type, as scan's own buffers start."""
    from jax._src.lax.control_flow import loops as _loops
    return _loops._empty_array((), (), aval)


def index_in_dim(x, i):
    from jax._src.lax import slicing as _slicing
    return _slicing.dynamic_index_in_dim(x, i, keepdims=False, allow_negative_indices=False)


def update_index_in_dim(x, update, i):
    from jax._src.lax import slicing as _slicing
    return _slicing.dynamic_update_index_in_dim(x, update, i, 0, allow_negative_indices=False)


def call_closed(closed, args):
    """Stage a call of a closed jaxpr, as ``scan``'s lowering does."""
    from jax._src.lax.eval_jaxpr import eval_jaxpr_p
    return list(eval_jaxpr_p.bind(*args, jaxpr=closed))


def _zero_tangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def observed(tapped_fn, plain_fn, args):
    """Evaluate ``tapped_fn(*args)``; differentiate ``plain_fn`` instead.

    Both compute the same values; ``tapped_fn`` also emits. Under any
    differentiation the derivatives (and the primal outputs) are exactly
    those of ``plain_fn``, the user's untapped code, while ``tapped_fn``
    runs on gradient-stopped inputs for its events alone.
    """
    def tapped(*a):
        with quiet():  # JAX may trace this later, outside the interception
            return list(tapped_fn(*a))

    f = jax.custom_jvp(tapped)

    # The events-only run is one opaque equation to autodiff: partial
    # evaluation (e.g. of jax.checkpoint) never looks inside it to recompute
    # parts, which a while loop holding callbacks could not support.
    events = jax.custom_jvp(tapped)
    events.defjvp(lambda p, t: (events(*p), [_zero_tangent(o) for o in events(*p)]))

    def rule(primals, tangents):
        events(*[jax.lax.stop_gradient(p) for p in primals])
        return jax.jvp(lambda *a: list(plain_fn(*a)), list(primals), list(tangents))

    f.defjvp(rule)
    return f(*args)


def any_lane(pred):
    return jax.lax.reduce_or(pred, tuple(range(pred.ndim)))


def select_lanes(pred, new, old):
    """Per-lane select with a leading-dims predicate (a batched while's)."""
    mask = jax.lax.broadcast_in_dim(pred, np.shape(new), tuple(range(pred.ndim)))
    return jax.lax.select(mask, new, old)


def optimization_barrier(x):
    return jax.lax.optimization_barrier(x)


def abstractify(x):
    return _core.shaped_abstractify(x)


def is_array_like(x) -> bool:
    """True for values that jax-tap passes to the traced program as data."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, Tracer))


# ------------------------------------------------------------ source sites
def site_of_traceback(tb, name_stack):
    """(file, line, column, backward?) of the first user frame, or None.

    A loop that autodiff transposed keeps its forward twin's source line; the
    name stack's ``transpose`` marker tells the backward loop apart."""
    if tb is None:
        return None
    frame = _source_info.user_frame(tb)
    if frame is None:
        return None
    backward = "transpose" in str(name_stack)
    site = (frame.file_name, frame.start_line, getattr(frame, "start_column", 0), backward)
    library = _library_caller(tb)
    return site if library is None else site + (library,)


# JAX's loop APIs and call plumbing: frames between a loop's bind and the code
# that asked for the loop
_PLUMBING = tuple(os.path.join("jax", "_src", p) for p in (
    os.path.join("lax", "control_flow", ""), "traceback_util.py", "api_util.py", "linear_util.py",
    "core.py", "api.py", "pjit.py", "profiler.py", "source_info_util.py", os.path.join("interpreters", "")))


def _library_caller(tb):
    """(file, line) of library code (e.g. ``jax.scipy``) that called the loop
    API on the user's behalf, or None when the user called it directly: two
    loops one library call runs get two addresses."""
    code, lasti = tb.raw_frames()
    for c, i in zip(code, lasti):
        name = c.co_filename
        if _source_info.is_user_filename(name):
            return None
        if name.startswith(_HERE) or any(p in name for p in _PLUMBING):
            continue
        frame = _source_info.raw_frame_to_frame(c, i)
        return (frame.file_name, frame.start_line)
    return None


def site_of_eqn(eqn):
    site = site_of_traceback(eqn.source_info.traceback, eqn.source_info.name_stack)
    if site is None:  # JAX keeps only the frames inside the innermost trace
        tb = eqn.source_info.traceback
        site = ("<no user frame>", str(eqn.source_info.name_stack), eqn.primitive.name,
                None if tb is None else _library_caller(tb))
    return site


def current_site():
    """The site of a bind happening now; the full Python stack as fallback
    (JAX's own traceback stops at the innermost jit being traced)."""
    name_stack = _source_info.current_name_stack()
    site = site_of_traceback(_source_info.current().traceback, name_stack)
    if site is not None:
        if not site[3] and _binder_name().startswith("_scan_transpose"):
            site = site[:3] + (True,) + site[4:]  # a backward loop (the name stack can miss it in a jit)
        return site
    import sys
    frame, library = sys._getframe(1), None
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if _source_info.is_user_filename(name):
            col = 0
            try:
                positions = list(code.co_positions())[frame.f_lasti // 2]
                col = positions[2] or 0
            except Exception:  # noqa: BLE001
                pass
            site = (name, frame.f_lineno, col, "transpose" in str(name_stack))
            return site if library is None else site + (library,)
        if library is None and not name.startswith(_HERE) and not any(p in name for p in _PLUMBING):
            library = (name, frame.f_lineno)  # library code that asked for this loop
        frame = frame.f_back
    return ("<no user frame>", str(name_stack), library)


# ------------------------------------------------------------ trace chain
# Traces inside which a loop bind is not a top-level user loop: loop bodies
# (the enclosing loop's rewrite reaches it) and JAX's own lowering rules
# (``scan`` lowers through ``while_loop`` via ``mlir.lower_fun``).
_LOOP_BODY_TRACES = frozenset({"scan", "while_body", "while_cond", "fori_loop", "lower_fun"})


_LOOPS_FILE = os.path.join("jax", "_src", "lax", "control_flow", "loops.py")
_BINDER_FILES = (_LOOPS_FILE, os.path.join("jax", "_src", "traceback_util.py"))
# the functions of loops.py that bind a loop the user asked for (lax.scan /
# lax.while_loop, which fori_loop and map call), and the transpose that binds
# a backward loop; every other binder there re-binds an existing loop
_USER_BINDERS = {"scan", "while_loop", "_scan_transpose_fancy", "_scan_transpose"}


# Traces whose jaxprs JAX differentiates or transposes as a whole: a tapped
# loop (a while loop, with callbacks) inside them could not be transposed.
_LINEAR_TRACES = frozenset({"custom_linear_solve", "custom_linear_solve solve",
                            "custom_linear_solve transpose_solve", "custom_root tangent_solve"})


def _in_derivative_code() -> bool:
    """True while JAX stages derivative code: partial evaluation (linearizing
    a custom_jvp rule, linear_transpose), a tangent trace, or a linear solve's
    operator."""
    trace = _core.trace_ctx.trace
    if isinstance(trace, _pe.JaxprTrace):
        return True
    if isinstance(trace, _pe.DynamicJaxprTrace):
        frame = getattr(trace, "frame", None)
        if getattr(frame, "auto_dce", False):
            return True
        dbg = getattr(frame, "debug_info", None)
        if getattr(dbg, "traced_for", None) in _LINEAR_TRACES:
            return True
    return False


def _binder_name() -> str:
    """Name of the function that called ``bind`` (past jax-tap's own frames)."""
    import sys
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_name


def _nested_in_loop_code(is_loop) -> bool:
    """True when JAX's loop code is on the Python stack above the code that
    binds this loop: the loop is bound while another loop's body (or its
    JVP, linearization or transpose) is being traced. Trace chains miss some
    of these, as autodiff re-traces bodies in traces of its own."""
    import sys
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back  # jax-tap's own frames
    if is_loop and frame is not None and not (
            frame.f_code.co_filename.endswith(_LOOPS_FILE) and frame.f_code.co_name in _USER_BINDERS):
        # not lax.scan / lax.while_loop: JAX re-binding an existing loop
        # equation (evaluating a jaxpr, a JVP, partial evaluation, batching)
        return True
    while frame is not None and frame.f_code.co_filename.endswith(_BINDER_FILES):
        frame = frame.f_back  # the loop API or rule binding this very loop (fori_loop -> scan)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_LOOPS_FILE):
            return True
        frame = frame.f_back
    return False


def inside_loop_body_trace(is_loop=False) -> bool:
    """True when the current bind happens while JAX traces a loop body or
    lowers a primitive, or (``is_loop``) re-binds a loop it already has or
    binds one into derivative code (which JAX may transpose)."""
    if _nested_in_loop_code(is_loop):
        return True
    if is_loop and _in_derivative_code():
        return True
    trace = _core.trace_ctx.trace
    seen = 0
    while trace is not None and seen < 1000:
        seen += 1
        frame = getattr(trace, "frame", None)
        dbg = getattr(frame, "debug_info", None)
        if dbg is not None and getattr(dbg, "traced_for", None) in _LOOP_BODY_TRACES:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


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


def jit_disabled() -> bool:
    return bool(jax.config.jax_disable_jit)


def at_base_trace() -> bool:
    """True when binding evaluates eagerly or stages into a jaxpr directly
    (not under a vmap/grad transformation trace, and not into autodiff's
    tangent jaxpr: that is derivative code, which JAX transposes)."""
    trace = _core.trace_ctx.trace
    if isinstance(trace, _core.EvalTrace):
        return True
    if isinstance(trace, _pe.DynamicJaxprTrace):
        # linearize's tangent traces (and remat's recompute traces) are the
        # auto-DCE staging traces
        return not getattr(getattr(trace, "frame", None), "auto_dce", False)
    return False


# ------------------------------------------------------------ interception
def install_bind(prim, fn):
    """Route ``prim.bind`` through ``fn`` (an instance attribute)."""
    prim.bind = fn


def uninstall_bind(prim):
    prim.__dict__.pop("bind", None)


def bind_is_patched(prim) -> bool:
    return "bind" in prim.__dict__


# ------------------------------------------------------------ jit-key state
# A thread-local config state that JAX includes in every jit cache key: while
# a with-block is active its token separates tapped from clean compilations.
TOKEN_STATE = _config.string_or_object_state(
    "jaxtap_tap_token",
    None,
    "jax-tap: the active tap configuration (internal; part of the jit key).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def set_thread_token(token) -> None:
    """This thread's token; None removes the thread's own value, so the
    thread sees the global one again."""
    TOKEN_STATE.set_local(_config.config_ext.unset if token is None else token)


def set_global_token(token) -> None:
    """The token threads without a block of their own see (None: clean)."""
    TOKEN_STATE.set_global(token)


def thread_token():
    return TOKEN_STATE.value


def token_state_in_trace_context(token) -> bool:
    """True when ``token`` shows up in JAX's trace context (the jit key)."""
    prev = TOKEN_STATE.swap_local(token)
    try:
        return any(x is token for x in _config.trace_context())
    finally:
        TOKEN_STATE.set_local(prev)


def effects_barrier():
    jax.effects_barrier()


class _Busy(threading.local):
    depth = 0


BUSY = _Busy()


class quiet:
    """While active on this thread, with-form interception stands aside
    (jax-tap's own tracing, and programs the wrapping form already tapped)."""

    __slots__ = ()

    def __enter__(self):
        BUSY.depth += 1

    def __exit__(self, *exc):
        BUSY.depth -= 1
        return False


def _primitive_table():
    table = {}
    for attr in dir(_P):
        prim = getattr(_P, attr)
        if isinstance(prim, _core.Primitive):
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


def collect_names(jaxpr, out=None) -> dict:
    """Primitive name -> count, including every nested jaxpr."""
    out = {} if out is None else out
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        out[name] = out.get(name, 0) + 1
        for sub in subjaxprs_of(eqn.params):
            collect_names(sub, out)
    return out
