"""The seam's staging helpers: trace, bind and evaluate equations exactly as
JAX does, and the few lax building blocks the loop rewrites use."""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .eqns import (CLOSED_CALL, CUSTOM_JVP, CUSTOM_VJP, DEBUG_EFFECTS, JIT, REMAT, ClosedJaxpr, Literal, Tracer,
                   closed_call_p, hi_call_p, impl_of, loop_body, loop_scope, subjaxprs_of)
from .keys import restore_thread_token, swap_thread_token, token_state
from .stack import bind_is_patched, quiet
from .versions import internal

__all__ = [
    "RUNTIME_ERRORS",
    "trace_closed",
    "spec_of",
    "eval_eqn",
    "bind_with_params",
    "bind_original",
    "eval_jaxpr",
    "has_debug_effects",
    "eval_jaxpr_quiet",
    "clean_eager_dispatch",
    "while_loop",
    "empty_stack",
    "empty_like",
    "zeros_of",
    "index_in_dim",
    "update_index_in_dim",
    "call_closed",
    "any_lane",
    "select_lanes",
    "optimization_barrier",
    "abstractify",
    "keep_weak_types",
    "is_array_like",
    "holds_refs",
    "effects_barrier",
    "hi_expansion",
    "impl_expansion",
]

_core = internal("jax._src.core")

_pe = internal("jax._src.interpreters.partial_eval")
_source_info = internal("jax._src.source_info_util")
_scan_loops = internal("jax._src.lax.control_flow.loops")
_slicing = internal("jax._src.lax.slicing")
_eval_jaxpr_mod = internal("jax._src.lax.eval_jaxpr")
_state_types = internal("jax._src.state.types")
_lax = internal("jax._src.lax.lax")
_dispatch = internal("jax._src.dispatch")
_mesh_mod = internal("jax._src.mesh")

# What a compiled program raises while it runs (a host callback that raised,
# a runtime check): the program's own failure, never a rewrite's.
RUNTIME_ERRORS = tuple(e for e in (getattr(jax.errors, "JaxRuntimeError", None),) if e is not None) or (RuntimeError,)

# ------------------------------------------------------------ jaxpr tools
def trace_closed(fn: Callable, in_avals: Sequence[Any]) -> ClosedJaxpr:
    """Trace ``fn(*flat_args) -> list`` over abstract values to a ClosedJaxpr."""
    specs = [spec_of(a) for a in in_avals]
    closed = jax.make_jaxpr(lambda *a: list(fn(*a)))(*specs)
    return closed


def spec_of(aval):
    """A ShapeDtypeStruct for ``aval``; it keeps the value's sharding where
    the type holds one (a mesh with explicit axes) and, inside
    ``shard_map``, its manual-axis type (which mesh axes it varies over)."""
    weak = getattr(aval, "weak_type", False)
    mat = getattr(aval, "manual_axis_type", None)
    sharding = getattr(aval, "sharding", None)
    typed = not getattr(getattr(sharding, "mesh", None), "empty", True)
    if mat is not None and not mat.empty:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak, sharding=sharding,
                                    manual_axis_type=mat)
    if typed:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak, sharding=sharding)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)


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
eval_jaxpr = jax.core.eval_jaxpr


def has_debug_effects(jaxpr) -> bool:
    """Does ``jaxpr``, or a jaxpr inside it, hold one of the user's debug
    effects (``DEBUG_EFFECTS``: ``jax.debug.callback``, ``jax.debug.print``,
    ``inspect_array_sharding``)?"""
    return any(eqn.primitive.name in DEBUG_EFFECTS or any(map(has_debug_effects, subjaxprs_of(eqn.params)))
               for eqn in jaxpr.eqns)


# the calls eval_jaxpr_quiet opens (the param holding the called jaxpr)
_CALLS = {JIT: "jaxpr", REMAT: "jaxpr", CLOSED_CALL: "call_jaxpr", CUSTOM_JVP: "call_jaxpr", CUSTOM_VJP: "call_jaxpr"}


def eval_jaxpr_quiet(jaxpr, consts, *args):
    """``eval_jaxpr`` without the user's debug effects, at top level and in
    the calls it makes (``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp``
    functions: those inlined, their rules unused: only values are asked):
    for a while loop's condition evaluated where the untapped loop would not
    evaluate it. A debug effect deeper (a ``cond`` branch, a loop) fires."""
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in DEBUG_EFFECTS and not eqn.outvars:
            continue
        invals = [read(v) for v in eqn.invars]
        sub = eqn.params.get(_CALLS[name]) if name in _CALLS else None
        inner = getattr(sub, "jaxpr", sub)  # (a checkpoint holds an open jaxpr)
        if sub is not None and has_debug_effects(inner):
            outs = eval_jaxpr_quiet(inner, getattr(sub, "consts", ()) if inner is not sub else (), *invals)
        else:
            outs = eval_eqn(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def while_loop(cond_fun, body_fun, init):
    """``lax.while_loop`` over a tuple carry, marked as ours (LOOP_SCOPE): a
    with-block that later walks a program holding it never taps it again."""
    with loop_scope():
        return jax.lax.while_loop(cond_fun, lambda s: tuple(body_fun(s)), tuple(init))


def empty_stack(length, aval):
    """The ys buffer ``scan``'s own lowering starts from, typed on ``aval``'s
    own mesh (JAX 0.12 would put a mesh-less y, a constant, on the context
    mesh: another type than the scan's ys)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    own = getattr(mesh, "empty", False) and hasattr(_mesh_mod, "use_abstract_mesh")
    with _mesh_mod.use_abstract_mesh(mesh) if own else contextlib.nullcontext():
        return _scan_loops._empty_array((length,), (None,), aval)


def empty_like(aval):
    """An (unspecified) array of ``aval``'s type, as scan's own buffers start."""
    return _scan_loops._empty_array((), (), aval)


def zeros_of(aval):
    """Zeros of ``aval``'s shape and dtype (uint32 for a PRNG key type)."""
    try:
        return np.zeros(aval.shape, aval.dtype)
    except TypeError:  # an extended dtype (PRNG keys): zeros shaped as its key data
        key_shape = tuple(getattr(getattr(aval.dtype, "_impl", None), "key_shape", ()))
        return np.zeros(tuple(aval.shape) + key_shape, np.uint32)


def index_in_dim(x, i):
    return _slicing.dynamic_index_in_dim(x, i, keepdims=False, allow_negative_indices=False)


def update_index_in_dim(x, update, i):
    return _slicing.dynamic_update_index_in_dim(x, update, i, 0, allow_negative_indices=False)


def call_closed(closed, args):
    """Stage a call of a closed jaxpr, as ``scan``'s lowering does."""
    eval_jaxpr_p = _eval_jaxpr_mod.eval_jaxpr_p
    # JAX >= 0.11 made eval_jaxpr the one call primitive (closed_call_p is
    # it), parameterized like every call by ``call_jaxpr``
    if eval_jaxpr_p is closed_call_p:
        return list(eval_jaxpr_p.bind(*args, call_jaxpr=closed))
    if jax.config.jax_enable_checks:
        # JAX 0.10: under vmap, a while body holding eval_jaxpr restages it as
        # a closed_call that JAX's own checker rejects (its `name` param);
        # the equations inline instead (XLA inlines the call either way)
        with quiet():
            return list(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args))
    return list(eval_jaxpr_p.bind(*args, jaxpr=closed))


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


def keep_weak_types(avals, outs) -> list:
    """A rewritten loop's outputs, weakly typed where ``avals`` (its own
    outputs' types, or its body's) are.

    A rewrite builds some outputs afresh (a scan's stacked ``ys`` in a
    buffer); a weak type lost there would change the dtype JAX promotes the
    user's later arithmetic to (weak f32 ``ys * bf16`` is bf16, strong is
    f32). The conversion is to the same dtype: XLA drops it.
    """
    kept = list(outs)
    for i, (aval, x) in enumerate(zip(avals, outs)):
        if getattr(aval, "weak_type", False) and not getattr(abstractify(x), "weak_type", True):
            kept[i] = _lax._convert_element_type(x, aval.dtype, weak_type=True)
    return kept


def holds_refs(prim, params, values) -> bool:
    """Does a loop use mutable array references (``jax.new_ref``,
    ``run_state``): an operand that is one, or a body that makes or touches
    one? JAX cannot discharge state through the wrappers a tapped loop is
    made of."""
    ref = getattr(_state_types, "AbstractRef", None)
    if ref is None:
        return False
    state = tuple(c for c in (getattr(_state_types, "RefEffect", None),
                              getattr(_core, "InternalMutableArrayEffect", None)) if c is not None)
    for body in (loop_body(prim, params), params.get("cond_jaxpr")):
        if body is not None and any(isinstance(e, state) for e in getattr(body, "effects", None) or
                                    body.jaxpr.effects):
            return True
    for v in values:
        try:
            if isinstance(jax.typeof(v), ref):
                return True
        except Exception:  # noqa: BLE001 - not a JAX value: not a reference
            pass
    return False


def is_array_like(x) -> bool:
    """True for values that jax-tap passes to the traced program as data."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, Tracer))


def effects_barrier():
    jax.effects_barrier()


_HI_EXPANSIONS: dict = {}  # id(hijax primitive) -> (primitive, expansion or None)


def hi_expansion(params):
    """The closed jaxpr a hijax primitive lowers to (the equations its
    ``expand`` stages), or None where it cannot be staged on its own."""
    prim = params["_prim"]
    hit = _HI_EXPANSIONS.get(id(prim))
    if hit is not None and hit[0] is prim:
        return hit[1]
    try:
        with quiet():
            expanded = trace_closed(lambda *a: hi_call_p.to_lojax(*a, _prim=prim), list(prim.in_avals_flat))
    except Exception:  # noqa: BLE001 - a hijax type (not an array) or a rule that needs a trace
        expanded = None
    if len(_HI_EXPANSIONS) > 4096:
        _HI_EXPANSIONS.clear()
    _HI_EXPANSIONS[id(prim)] = (prim, expanded)
    return expanded


class _own_tracebacks:
    """Equations staged within record the Python stack of their own bind
    (JAX's transposition and jaxpr evaluation pin the traceback of the
    equation they replay), under ``name_stack``."""

    def __init__(self, name_stack):
        self.name_stack = name_stack

    def __enter__(self):
        ctx = _source_info._source_info_context
        self.prev = ctx.context
        ctx.context = _source_info.SourceInfo(None, self.name_stack)

    def __exit__(self, *exc):
        _source_info._source_info_context.context = self.prev
        return False


_IMPL_EXPANSIONS: dict = {}  # id(params) -> (params, avals, expansion or None)


def impl_expansion(prim, params, avals, eqn=None):
    """The closed jaxpr ``prim`` lowers to (its implementation traced on
    ``avals``, as its ``lower_fun`` lowering does), or None; its equations
    carry ``eqn``'s name stack and the Python stack of their own binds."""
    key = id(params)
    hit = _IMPL_EXPANSIONS.get(key)
    if hit is not None and hit[0] is params and hit[1] == avals:
        return hit[2]
    impl = impl_of(prim)
    try:
        name_stack = _source_info.current_name_stack()
        if eqn is not None:
            name_stack = name_stack + eqn.source_info.name_stack
        with quiet(), _own_tracebacks(name_stack):
            expanded = trace_closed(lambda *a: impl(*a, **params), list(avals))
    except Exception:  # noqa: BLE001 - an implementation that cannot be traced on its own
        expanded = None
    if len(_IMPL_EXPANSIONS) > 4096:
        _IMPL_EXPANSIONS.clear()
    _IMPL_EXPANSIONS[key] = (params, list(avals), expanded)
    return expanded


# ------------------------------------------------------- eager primitives
class _Eager:
    lock = threading.Lock()
    orig = None  # dispatch.xla_primitive_callable while ours stands in


def _primitive_callable(prim, **params):
    """``xla_primitive_callable`` (an eager primitive's compiled program)
    under the clean jit key, for a primitive that holds no jaxpr and whose
    bind jax-tap does not intercept: its program is the same in a block and
    out of one, so a block reuses the clean compilation instead of compiling
    every eager op once more per configuration."""
    orig = _Eager.orig or _dispatch.xla_primitive_callable
    if token_state(create=False) is None or bind_is_patched(prim) or subjaxprs_of(params):
        return orig(prim, **params)
    return functools.partial(_clean, _clean(orig, prim, **params))


def _clean(fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` under the clean jit key (this thread's token
    swapped out, then back)."""
    prev = swap_thread_token(None)
    try:
        return fn(*args, **kwargs)
    finally:
        restore_thread_token(prev)


_primitive_callable.__jaxtap_patch__ = True


def clean_eager_dispatch(on: bool) -> bool:
    """While ``on`` (a with-block is active), eager primitives outside
    jax-tap's interception run their clean compilations (see
    :func:`_primitive_callable`). False on a JAX without the hook."""
    if _dispatch is None or not callable(getattr(_dispatch, "xla_primitive_callable", None)):
        return False
    with _Eager.lock:
        current = _dispatch.xla_primitive_callable
        if on and not getattr(current, "__jaxtap_patch__", False):
            for name in ("cache_clear", "cache_info", "cache_parameters"):  # (JAX's test helpers read them)
                if hasattr(current, name):
                    setattr(_primitive_callable, name, getattr(current, name))
            _Eager.orig, _dispatch.xla_primitive_callable = current, _primitive_callable
        elif not on and getattr(current, "__jaxtap_patch__", False):
            _dispatch.xla_primitive_callable = _Eager.orig
    return True
