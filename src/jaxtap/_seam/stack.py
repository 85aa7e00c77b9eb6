"""The seam's interception and call-stack heuristics: where a bind comes
from (the user's line, a library, JAX's own loop machinery, derivative code),
how a primitive's bind is routed through jax-tap, and the jit-key state that
separates tapped from clean compilations."""
from __future__ import annotations

import functools
import inspect
import os
import sys
import threading

import jax

from .versions import internal

__all__ = [
    "site_of_traceback",
    "site_of_eqn",
    "current_site",
    "describe_site",
    "bound_by_transpose",
    "loop_site",
    "inside_loop_body_trace",
    "impl_bind_is_nested",
    "in_custom_body_trace",
    "in_derivative_code",
    "in_tangent_code",
    "barrier_here",
    "current_trace",
    "differentiated",
    "differentiating",
    "jit_disabled",
    "at_base_trace",
    "evaluating_eagerly",
    "install_bind",
    "uninstall_bind",
    "bind_is_patched",
    "BUSY",
    "quiet",
]

_core = internal("jax._src.core")
_pe = internal("jax._src.interpreters.partial_eval")
_ad = internal("jax._src.interpreters.ad")
_source_info = internal("jax._src.source_info_util")
_traceback_util = internal("jax._src.traceback_util")

# Hide jax-tap's own frames (the package, this seam included) from JAX's
# source info and filtered tracebacks, so that an equation's "user frame" is
# the user's line, never ours.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _source_info is not None and _traceback_util is not None:
    _source_info.register_exclusion(_HERE)
    _traceback_util.register_exclusion(_HERE)


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
    code, lasti = tb.raw_frames()
    return (frame.file_name, frame.start_line, getattr(frame, "start_column", 0), backward,
            _library_caller(code, lasti), _direct_caller(code, lasti))


# JAX's loop APIs and call plumbing: frames between a loop's bind and the code
# that asked for the loop
_PLUMBING = tuple(os.path.join("jax", "_src", p) for p in (
    os.path.join("lax", "control_flow", ""), "traceback_util.py", "api_util.py", "linear_util.py",
    "core.py", "api.py", "pjit.py", "profiler.py", "source_info_util.py", os.path.join("interpreters", "")))


def _library_caller(code, lasti):
    """(file, line) of library code (e.g. ``jax.scipy``) that called the loop
    API on the user's behalf, or None when the user called it directly: two
    loops one library call runs get two addresses."""
    for c, i in zip(code, lasti):
        name = c.co_filename
        if _source_info.is_user_filename(name):
            return None
        if name.startswith(_HERE) or any(p in name for p in _PLUMBING):
            continue
        frame = _source_info.raw_frame_to_frame(c, i)
        return (frame.file_name, frame.start_line)
    return None


def _direct_caller(code, lasti):
    """(file, line) of the user line that called the loop's function (the
    next user frame outward, past JAX's frames and jax-tap's), or None: a
    helper's loop called from two lines of yours gets two addresses, and
    ``f(x)``, ``jax.jit(f)(x)`` and ``tap.verbose(f)(x)`` on one line agree."""
    user = _source_info.is_user_filename
    first = None
    for k, c in enumerate(code):
        if user(c.co_filename):
            if first is not None:
                frame = _source_info.raw_frame_to_frame(c, lasti[k])
                return (frame.file_name, frame.start_line)
            first = k
        elif first is not None and c.co_filename.startswith(_HERE):
            return None  # a tap.verbose wrapper's call: its addresses do not depend on where it is called
    return None


def site_of_eqn(eqn):
    site = site_of_traceback(eqn.source_info.traceback, eqn.source_info.name_stack)
    if site is None:  # JAX keeps only the frames inside the innermost trace
        tb = eqn.source_info.traceback
        site = ("<no user frame>", str(eqn.source_info.name_stack), eqn.primitive.name,
                None if tb is None else _library_caller(*tb.raw_frames()))
    return site


def describe_site(name, site) -> str:
    """``"mul at model.py:17"``: a primitive and the user line it came from."""
    if isinstance(site, tuple) and len(site) > 1 and isinstance(site[0], str) and isinstance(site[1], int):
        return f"{name} at {os.path.basename(site[0])}:{site[1]}"
    return name


def current_site():
    """The site of a bind happening now; the full Python stack as fallback
    (JAX's own traceback stops at the innermost jit being traced)."""
    name_stack = _source_info.current_name_stack()
    site = site_of_traceback(_source_info.current().traceback, name_stack)
    if site is not None:
        if not site[3] and _binder_name().startswith("_scan_transpose"):
            site = site[:3] + (True,) + site[4:]  # a backward loop (the name stack can miss it in a jit)
        return site
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
            up = frame.f_back
            while up is not None and not _source_info.is_user_filename(up.f_code.co_filename):
                if up.f_code.co_filename.startswith(_HERE):
                    up = None  # a tap.verbose wrapper's call (see _direct_caller)
                    break
                up = up.f_back
            caller = None if up is None else (up.f_code.co_filename, up.f_lineno)
            return (name, frame.f_lineno, col, "transpose" in str(name_stack), library, caller)
        if library is None and not name.startswith(_HERE) and not any(p in name for p in _PLUMBING):
            library = (name, frame.f_lineno)  # library code that asked for this loop
        frame = frame.f_back
    return ("<no user frame>", str(name_stack), library)


_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def loop_site(prim, params, site):
    """A loop's site, told apart by its carry's structure when the line is
    in an installed library: a library may bind every loop it runs from one
    line of its own (Equinox's ``while_loop``; JAX counts its frames as the
    user's), so the line alone would give different loops one address. Only
    leaf count, dtypes and ranks: the same loop keeps its address when its
    shapes change."""
    if site is None or not isinstance(site[0], str) or not any(p in site[0] for p in _INSTALLED):
        return site
    from .eqns import scan_p, scan_parts, while_parts
    try:
        if prim is scan_p:
            body, nc, ncar, _ = scan_parts(params)
            carry = body.in_avals[nc:nc + ncar]
        else:
            _, _, body, bnc = while_parts(params)
            carry = body.in_avals[bnc:]
        shape = tuple((str(a.dtype), len(a.shape)) for a in carry)
    except Exception:  # noqa: BLE001 - the line alone, as for a user's loop
        return site
    return tuple(site) + (shape,)


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


def in_derivative_code() -> bool:
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


def in_tangent_code() -> bool:
    """:func:`in_derivative_code`, or a custom_jvp rule or a function given
    to ``jax.linear_transpose`` being traced further up the stack (a jit
    inside one included): where a primitive's value may be a tangent. A
    loop there is still tapped (the rule's primal loops are the user's).
    Also a reduction's combiner (a jit inside one included)."""
    return in_derivative_code() or (isinstance(_core.trace_ctx.trace, _pe.DynamicJaxprTrace)
                                    and _inside_tangent_code())


def _code_of(module, name):
    """The code object of ``module.name``, seen through decorators and
    ``functools.partial`` (JAX's ``lu.transformation`` decorators); None
    where it moved (the check then finds nothing)."""
    fn = getattr(internal(module), name, None)
    candidates = [fn]
    while candidates:
        fn = candidates.pop()
        if isinstance(fn, functools.partial):
            candidates.extend([fn.func, *fn.args])
            continue
        fn = inspect.unwrap(fn) if callable(fn) else fn
        if getattr(fn, "__name__", None) == name and hasattr(fn, "__code__"):
            return fn.__code__
    return None


# Functions JAX later transposes whole, tangents and all: a custom_jvp rule
# (JAX traces it with the tangents as inputs) and ``linear_transpose``'s. A
# jit inside one (``jnp.multiply`` is one, lineax's solves are) is traced
# afresh, by a trace that cannot see them: only the Python stack can. A tap
# there could not be transposed (a NaN tripwire's cond on a tangent).
_TANGENT_CODES = frozenset(filter(None, (_code_of("jax._src.api", "linear_transpose"),
                                          _code_of("jax._src.custom_derivatives", "_flatten_jvp"),
                                          # a reduction's or scatter's combiner (x.at[i].add,
                                          # lax.reduce): XLA applies it, it must stay effect-free
                                          _code_of("jax._src.lax.lax", "_reduction_jaxpr"),
                                          _code_of("jax._src.lax.lax", "_variadic_reduction_jaxpr"))))


def _inside_tangent_code() -> bool:
    """Is JAX tracing a custom_jvp rule or a function to transpose, further
    up the stack? (Only a tapped primitive's bind asks: trace time.)"""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _TANGENT_CODES:
            return True
        frame = frame.f_back
    return False


def binder_frame():
    """The frame of the function that called ``bind`` (past jax-tap's own
    frames), or None."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    return frame


def _binder_name() -> str:
    """Name of the function that called ``bind`` (past jax-tap's own frames)."""
    frame = binder_frame()
    return "" if frame is None else frame.f_code.co_name


def bound_by_transpose() -> bool:
    """Is the loop being bound right now bound by scan's transpose rule
    itself (a backward scan), not by code it traces on the way?"""
    return _binder_name().startswith("_scan_transpose")


def current_trace():
    """The innermost jaxpr trace a primitive bound now is staged into (its
    identity only): a loop under a ``vmap`` or a derivative shares its
    jaxpr's trace. Not further out: a nested jit's or a ``cond`` branch's
    jaxpr is cached, and reused in other programs as it was traced."""
    trace = current = _core.trace_ctx.trace
    seen = 0
    while trace is not None and seen < 1000:
        seen += 1
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return trace
        trace = getattr(trace, "parent_trace", None)
    return current


def barrier_here():
    """(caller's frame, current trace): where a wrapped call starts. Loop
    code and traces outside it (a user's loop body that calls a
    ``tap.verbose`` function) do not make the call's loops nested."""
    return sys._getframe(1), _core.trace_ctx.trace


def _nested_in_loop_code(is_loop, barrier=None) -> bool:
    """True when JAX's loop code is on the Python stack above the code that
    binds this loop (up to ``barrier``'s frame): the loop is bound while
    another loop's body (or its JVP, linearization or transpose) is being
    traced. Trace chains miss some of these, as autodiff re-traces bodies in
    traces of its own."""
    stop = None if barrier is None else barrier[0]
    frame = binder_frame()  # past jax-tap's own frames
    if is_loop and frame is not None and not (
            frame.f_code.co_filename.endswith(_LOOPS_FILE) and frame.f_code.co_name in _USER_BINDERS):
        # not lax.scan / lax.while_loop: JAX re-binding an existing loop
        # equation (evaluating a jaxpr, a JVP, partial evaluation, batching)
        return True
    while frame is not None and frame.f_code.co_filename.endswith(_BINDER_FILES):
        frame = frame.f_back  # the loop API or rule binding this very loop (fori_loop -> scan)
    while frame is not None and frame is not stop:
        code = frame.f_code
        if code.co_filename.endswith(_LOOPS_FILE) or _shape_only(code):
            return True
        frame = frame.f_back
    return False


# A primitive's abstract evaluation (its shape rule tracing its
# implementation, as lineax's does) traces loops that never run: never
# tapped, never numbered. (Not ``jax.eval_shape`` as such: JAX's hijax
# primitives trace their expansion with it, and that trace is the one their
# lowering reuses.)
_SHAPE_ONLY = {"abstract_eval_": os.path.join("jax", "_src", "core.py")}


def _shape_only(code) -> bool:
    suffix = _SHAPE_ONLY.get(code.co_name)
    return suffix is not None and code.co_filename.endswith(suffix)


def inside_loop_body_trace(is_loop=False, barrier=None) -> bool:
    """True when the current bind happens while JAX traces a loop body or
    lowers a primitive, or (``is_loop``) re-binds a loop it already has or
    binds one into derivative code (which JAX may transpose). Loop code and
    traces outside ``barrier`` (from :func:`barrier_here`) do not count."""
    if _nested_in_loop_code(is_loop, barrier):
        return True
    if is_loop and in_derivative_code():
        return True
    trace = _core.trace_ctx.trace
    stop = None if barrier is None else barrier[1]
    seen = 0
    while trace is not None and trace is not stop and seen < 1000:
        seen += 1
        frame = getattr(trace, "frame", None)
        dbg = getattr(frame, "debug_info", None)
        if dbg is not None and getattr(dbg, "traced_for", None) in _LOOP_BODY_TRACES:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# JAX's transformation rules run here: a primitive bound inside one is the
# rule re-binding it (a JVP's tangent solve, a batched variant), not the user
_PARTIAL_EVAL = os.path.join("jax", "_src", "interpreters", "partial_eval.py")
_RULE_FRAMES = tuple(os.path.join("jax", "_src", "interpreters", f) for f in ("ad.py", "batching.py")) + (_PARTIAL_EVAL,)


def impl_bind_is_nested(barrier=None) -> bool:
    """True when a library primitive that lowers by tracing its
    implementation is bound where jax-tap must leave it alone: inside a loop
    body being traced or a lowering, in derivative code, or by one of JAX's
    transformation rules."""
    if inside_loop_body_trace(False, barrier) or in_derivative_code():
        return True
    stop = None if barrier is None else barrier[0]
    frame = sys._getframe(1)
    while frame is not None and frame is not stop:
        code = frame.f_code
        if code.co_name.startswith("process_") and code.co_filename.endswith(_RULE_FRAMES):
            return True
        if _shape_only(code):
            return True
        frame = frame.f_back
    return False


def in_custom_body_trace(barrier=None) -> bool:
    """True while JAX traces the body of a ``custom_jvp``/``custom_vjp``
    function for a jaxpr: under a transformation that uses the rules the
    traced body may be discarded (the rule calls the function again)."""
    stop = None if barrier is None else barrier[0]
    frame = sys._getframe(1)
    while frame is not None and frame is not stop:
        code = frame.f_code
        if code.co_name in ("process_custom_jvp_call", "process_custom_vjp_call") \
                and code.co_filename.endswith(_PARTIAL_EVAL):
            return True
        frame = frame.f_back
    return False


_AUTODIFF_TRACES = tuple(t for t in (getattr(_ad, "JVPTrace", None), getattr(_ad, "LinearizeTrace", None)) if t)


class _Differentiating(threading.local):
    value = None  # None: look at the trace chain; True / False: decided by the caller


_DIFFERENTIATING = _Differentiating()


class differentiated:
    """Within: :func:`differentiating` answers ``value`` (True: what is
    staged now will be differentiated; False: it never is, e.g. an
    events-only run; None: read the trace chain)."""

    __slots__ = ("value", "prev")

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.prev = _DIFFERENTIATING.value
        _DIFFERENTIATING.value = self.value

    def __exit__(self, *exc):
        _DIFFERENTIATING.value = self.prev
        return False


def differentiating() -> bool:
    """True while an autodiff trace (JVP or linearize) is active: what is
    bound now is differentiated by JAX's rules as it is bound."""
    if _DIFFERENTIATING.value is not None:
        return _DIFFERENTIATING.value
    trace, seen = _core.trace_ctx.trace, 0
    while trace is not None and seen < 1000:
        if isinstance(trace, _AUTODIFF_TRACES):
            return True
        trace, seen = getattr(trace, "parent_trace", None), seen + 1
    return False


def jit_disabled() -> bool:
    return bool(jax.config.jax_disable_jit)


def evaluating_eagerly() -> bool:
    """True when a bind now evaluates on concrete values (no trace at all)."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


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


class _Busy(threading.local):
    depth = 0
    token_sets = 0  # set_thread_token calls on this thread (see callback._call)
    hop_key = None  # in a hop: the jit key a consumer's swap replaced (callback._UNSET: none yet)
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
