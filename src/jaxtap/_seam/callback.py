"""The host callback every hop stages: :func:`host_callback`.

``jax.debug.callback`` spends about 60 µs of host time per call before the
user's function runs (it turns each operand back into a device array, under
three configuration contexts); XLA's own Python callback costs about 2 µs on
CPU. :func:`host_callback` stages the *same* XLA custom call as
``jax.debug.callback`` (so XLA compiles the program exactly as it would with
it) through a primitive of our own, ``jaxtap_callback``, whose host half hands the
numpy operands straight to the function.

It carries JAX's own debug effect, so every JAX rule about where a debug
callback may go (loop and cond bodies, ``jax.checkpoint``, custom
derivatives, dead-code elimination) holds for it unchanged; its batching,
differentiation and partial-evaluation rules are ``jax.debug.callback``'s.
On a JAX where any of that is missing, :func:`host_callback` is
``jax.debug.callback`` with the operands converted to numpy (``FAST`` is
False).

Example
-------
>>> import jax, jax.numpy as jnp
>>> seen = []
>>> jax.jit(lambda x: host_callback(lambda a: seen.append(a.sum()), x))(jnp.arange(3.0))
>>> jax.effects_barrier(); [float(v) for v in seen]
[3.0]
"""
from __future__ import annotations

import ctypes
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from .. import _host
from .._host import describe, pass_interrupt, raise_lost_interrupt, warn_once_now
from .eqns import BYTES_NAME, HOP_NAME
from .keys import restore_thread_token, token_state
from .stack import BUSY
from .versions import internal

__all__ = ["host_callback", "FAST_HOST_CALLBACK", "to_bytes"]

_core = internal("jax._src.core")
_debugging = internal("jax._src.debugging")
_cb = internal("jax._src.callback")
_mlir = internal("jax._src.interpreters.mlir")
_ad = internal("jax._src.interpreters.ad")
_batching = internal("jax._src.interpreters.batching")
_pe = internal("jax._src.interpreters.partial_eval")
_sharding_impls = internal("jax._src.sharding_impls")
_config = internal("jax._src.config")
_xc = internal("jax._src.lib", "xla_client")
_shard_map = internal("jax._src.shard_map")


def _as_numpy(args):
    return [a if isinstance(a, np.ndarray) else np.asarray(a) for a in args]


class _Pinned(threading.local):
    done = False


_PINNED = _Pinned()


def _pin_thread():
    """Keep the calling thread's Python state alive once the callback returns.

    XLA:CPU runs a callback on whichever of its threads reaches it (in a
    nest of loops, threads of its pool that Python did not start). On such a
    thread every call would create the thread's Python state and delete it
    on return, with its thread-locals (JAX's configuration contexts, ours):
    10-20 µs a hop, more than the rest of the hop. One more
    ``PyGILState_Ensure``, never released, keeps that state for the
    thread's life (one per XLA thread that calls back, a few KB each); the
    next call finds it, as on a Python thread.
    """
    _PINNED.done = True
    try:
        ctypes.pythonapi.PyGILState_Ensure()
    except Exception:  # noqa: BLE001 - not CPython: calls stay correct, only slower
        pass


def _call(fn, args, cpu_default):
    """Run ``fn`` on the host; it never raises into XLA (that would abort
    the user's program): our host functions guard themselves, this is the
    last net.

    While it runs, JAX work a consumer does (an ``on_step`` calling a
    jitted loop) is never tapped: the with-form stands aside (``BUSY``), so
    nothing recurses through its own events. A user's consumer also gets
    the clean jit key (:func:`consumer_key`), so what it compiles is never
    cached as the block's.
    """
    if not _PINNED.done:
        _pin_thread()
    busy = BUSY.__dict__  # this thread's (one thread-local lookup: this is every hop's path)
    try:
        raise_lost_interrupt()
        busy["depth"] = busy.get("depth", 0) + 1
        outer = busy.get("hop_key")  # (a hop inside a consumer's own work nests)
        busy["hop_key"] = _UNSET
        sets = busy.get("token_sets", 0)
        try:
            cpu = _host_device() if cpu_default else None
            if cpu is not None:  # a user consumer's jnp calls must not queue work on the waiting accelerator
                with jax.default_device(cpu):
                    fn(*args)
            else:
                fn(*args)
        finally:
            swapped = busy["hop_key"]
            busy["hop_key"] = outer
            # (unless the consumer set the thread's token itself: tap.emergency_restore())
            if swapped is not _UNSET and busy.get("token_sets", 0) == sets:
                restore_thread_token(swapped)
            busy["depth"] -= 1
    except BaseException as exc:  # noqa: BLE001 - totality
        pass_interrupt(exc)  # a Ctrl-C stops the run
        warn_once_now(f"jax-tap: a host callback failed and was skipped: {describe(exc)}")


_UNSET = object()  # a hop's jit key not swapped yet
_CPU = []  # the host's CPU device, looked up once; [None] where JAX has no CPU backend


def _host_device():
    """The CPU device a consumer's own JAX work goes to, or None where JAX
    runs without one (``JAX_PLATFORMS=cuda``): the consumer then runs as
    it is, its values are numpy arrays either way."""
    if not _CPU:
        try:
            _CPU.append(jax.local_devices(backend="cpu")[0])
        except Exception:  # noqa: BLE001 - no CPU backend (RuntimeError); never a reason to drop a hop
            _CPU.append(None)
    return _CPU[0]


def consumer_key() -> None:
    """Before a user's consumer runs in a hop: this thread's jit key is the
    clean one until the hop ends (swapped once per hop, and only for hops
    that reach user code: it costs about half a microsecond)."""
    busy = BUSY.__dict__
    if busy.get("hop_key") is _UNSET:
        state = token_state(create=False)
        if state is not None:
            busy["hop_key"] = state.swap_local(None)


_host.consumer_key = consumer_key  # (Guard calls it; _host cannot import the seam)


def _slow(fn, *args):
    """``jax.debug.callback`` with numpy operands: the portable way."""
    jax.debug.callback(lambda *a: _call(fn, _as_numpy(a), False), *args)


def _sharding(ctx):
    """The callback's sharding, as ``jax.debug.callback`` annotates it; the
    string "partial" where only part of a mesh is manual."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        if set(axis_context.mesh.axis_names) - set(axis_context.manual_axes):
            return "partial"
        if _config.use_shardy_partitioner.value:
            return _cb._get_sdy_array_list_for_callbacks(ctx.avals_out)
        sharding = _xc.OpSharding()
        sharding.type = _xc.OpSharding.Type.MANUAL
        return sharding
    if isinstance(axis_context, _sharding_impls.ShardingContext):
        if _config.use_shardy_partitioner.value:
            return _sharding_impls.SdyArrayList((_sharding_impls.SdyArray(
                mesh_shape=(), dim_shardings=(), logical_device_ids=(0,)),))
        sharding = _xc.OpSharding()
        sharding.type = _xc.OpSharding.Type.MAXIMAL
        sharding.tile_assignment_dimensions = [1]
        sharding.tile_assignment_devices = [0]
        return sharding
    return None


def _build():
    """The ``jaxtap_callback`` primitive with its rules, or None on a JAX that
    lacks one of the internals it needs."""
    hop_p = _core.Primitive(HOP_NAME)
    hop_p.multiple_results = True
    effect = _debugging.debug_effect

    @hop_p.def_impl
    def _impl(*args, fn, partitioned, on_batch):
        _call(fn, _as_numpy(args), False)
        return []

    @hop_p.def_effectful_abstract_eval
    def _abstract(*avals, fn, partitioned, on_batch):
        return [], {effect}

    def _lower_elsewhere(ctx, *args, fn, partitioned, on_batch):  # TPU and others: jax.debug.callback's lowering
        return _mlir.lower_fun(lambda *a: _slow(fn, *a) or [], multiple_results=True)(ctx, *args)

    def _lower(ctx, *args, fn, partitioned, on_batch):
        sharding = _sharding(ctx)
        if isinstance(sharding, str):  # part of a mesh manual: JAX's own gather-and-call
            return _lower_elsewhere(ctx, *args, fn=fn, partitioned=partitioned, on_batch=on_batch)
        cpu_default = any(p != "cpu" for p in ctx.module_context.platforms)

        def host(*flat):
            _call(fn, flat, cpu_default)
            return ()

        result, _, _ = _cb.emit_python_callback(ctx, host, None, list(args), ctx.avals_in, ctx.avals_out,
                                                has_side_effect=True, returns_token=True, partitioned=partitioned,
                                                sharding=sharding)
        return result

    def _batch(args, dims, *, fn, partitioned, on_batch):
        if on_batch is None:  # one callback per lane, as jax.debug.callback
            return _debugging.debug_batching_rule(args, dims, primitive=hop_p, fn=fn, partitioned=partitioned,
                                                  on_batch=None)
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        on_batch(*[jnp.moveaxis(x, d, 0) if d is not None else jnp.broadcast_to(x, (size, *x.shape))
                   for x, d in zip(args, dims)])
        return [], []

    _batching.primitive_batchers[hop_p] = _batch
    _ad.primitive_jvps[hop_p] = lambda primals, tangents, **params: (hop_p.bind(*primals, **params), [])
    _ad.primitive_transposes[hop_p] = lambda ct, *args, **params: [None] * len(args)
    _pe.partial_eval_jaxpr_custom_rules[hop_p] = functools.partial(_debugging._debug_partial_eval_custom,
                                                                   primitive=hop_p)

    def _eager_in_shard_map(mesh, *args, fn, partitioned, on_batch):  # as jax.debug.callback's: each device's block
        with _core.eval_context():
            blocks = list(zip(*map(list, args)))
        for block in blocks:
            _call(fn, _as_numpy(block), False)
        return []

    _shard_map.eager_rules[hop_p] = _eager_in_shard_map
    _mlir.register_lowering(hop_p, _lower, platform="cpu")
    _mlir.register_lowering(hop_p, _lower, platform="gpu")
    _mlir.register_lowering(hop_p, _lower_elsewhere)
    return hop_p


def _try_build(build=None):
    try:
        return (build or _build)()
    except Exception:  # noqa: BLE001 - any JAX may move its internals: fall back to jax.debug.callback
        return None


_HOP_P = _try_build()
FAST_HOST_CALLBACK = _HOP_P is not None


def _build_bytes():
    """``jaxtap_bytes``: ``bitcast_convert_type`` to bytes, transposable.

    A hop's operand may be a tangent: a tap inside a ``custom_jvp`` rule or a
    function given to ``jax.linear_transpose`` that JAX then transposes
    whole. The hop itself transposes to nothing, and so must every step that
    packs its operand; JAX's bitcast has no transpose rule. The bytes only
    feed the hop, so their cotangent is always zero. Same lowering, same
    program.
    """
    bytes_p = _core.Primitive(BYTES_NAME)

    def bitcast(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint8)

    bytes_p.def_impl(bitcast)
    def abstract(aval):
        size = np.dtype(aval.dtype).itemsize
        return _core.ShapedArray(tuple(aval.shape) + ((size,) if size > 1 else ()), np.dtype(np.uint8))

    bytes_p.def_abstract_eval(abstract)
    _mlir.register_lowering(bytes_p, _mlir.lower_fun(bitcast, multiple_results=False))
    _batching.primitive_batchers[bytes_p] = lambda args, dims: (bytes_p.bind(*args), dims[0])

    def jvp(primals, tangents):  # integer bytes: a zero tangent, as bitcast's own rule gives
        out = bytes_p.bind(*primals)
        return out, _ad.Zero(_core.ShapedArray(tuple(out.shape), jax.dtypes.float0))

    _ad.primitive_jvps[bytes_p] = jvp
    _ad.primitive_transposes[bytes_p] = lambda ct, x: [None]
    return bytes_p


_BYTES_P = _try_build(_build_bytes)


def to_bytes(x):
    """``x`` (numeric, at least a byte wide) bitcast to uint8, a trailing axis
    of its item size added (dropped for uint8 itself), transposable."""
    if _BYTES_P is None:
        return jax.lax.bitcast_convert_type(x, jnp.uint8)
    return _BYTES_P.bind(x)


def host_callback(fn, *args, partitioned=False, on_batch=None):
    """Stage ``fn(*numpy operands)`` on the host, as ``jax.debug.callback``
    would stage it (same XLA custom call, same effect, same rules under
    autodiff and ``jax.checkpoint``), at a fraction of its host cost.

    ``fn`` receives numpy arrays and must return nothing; if it raises, the
    program goes on (one warning). Under ``vmap`` the callback runs once per
    lane, unless ``on_batch`` is given: then ``on_batch(*operands)`` is
    called at trace time with every operand batched along a leading axis,
    and stages what it wants instead (one callback for all lanes).
    """
    if _HOP_P is None:
        _slow(fn, *args)
        return
    _HOP_P.bind(*args, fn=fn, partitioned=partitioned, on_batch=on_batch)
