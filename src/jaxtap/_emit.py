"""Emission: the only module that creates host callbacks.

Everything that leaves the device goes through :func:`jax.debug.callback`
here. The device side runs the user's ``select`` (inside the sampled branch
only), ships the array leaves of its result, and the host side rebuilds the
pytree from host copies and hands a :class:`TapEvent` to a sink.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from . import _seam
from ._event import TapEvent
from ._host import Guard


class TapSelectError(TypeError):
    """A ``select`` function failed while jax-tap traced it."""


def _describe(leaves) -> str:
    parts = []
    for i, x in enumerate(leaves):
        aval = getattr(x, "aval", None)
        if aval is not None:
            parts.append(f"  leaves[{i}]: {aval.str_short()}")
        else:
            parts.append(f"  leaves[{i}]: {type(x).__name__}")
    return "\n".join(parts) or "  (no leaves)"


def run_select(select, select_path, leaves, path, what="carry leaves"):
    """Call the user's select on device values; explain failures clearly."""
    if select is None:
        return tuple(leaves)
    try:
        if select_path == "keyword":
            return select(tuple(leaves), path=path)
        if select_path == "positional":
            return select(tuple(leaves), path)
        return select(tuple(leaves))
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise TapSelectError(
            f"jax-tap: your `select` failed while tracing the tap at {path!r}: "
            f"{type(exc).__name__}: {exc}\n"
            f"select receives a tuple of the {what} (they are traced JAX values, so "
            "use jnp operations, not Python control flow on their values):\n"
            f"{_describe(leaves)}"
        ) from None


def _to_host(x):
    a = np.array(x, copy=True)
    return a[()] if a.ndim == 0 else a


def _split_payload(value):
    """Array leaves travel as operands; anything else is baked in statically."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    dynamic, static = [], {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, (jax.Array, _seam.Tracer)):
            dynamic.append(leaf)
        elif isinstance(leaf, (np.ndarray, np.generic)):
            dynamic.append(jnp.asarray(leaf))
        else:
            static[i] = leaf
    return dynamic, static, treedef, len(leaves)


class Part:
    """One event a tap ships at a step: where it goes and how it is built."""

    __slots__ = ("deliver", "path", "top", "total", "kind", "payload_fn")

    def __init__(self, deliver, path, top, total, kind, payload_fn):
        self.deliver = deliver  # deliver(event, top), host side
        self.path = path
        self.top = top
        self.total = total
        self.kind = kind
        self.payload_fn = payload_fn  # () -> device-side value (the select)


def make_host_fn(parts, layouts, guard: Guard, sample_every, flagged=False):
    """The host half: rebuild each part's event and deliver it, never raising.

    Returns ``host(step, [flag], *arrays, lane=None)``.
    """

    def host(step, *arrays, lane=None):
        try:
            if flagged:
                # Under vmap a gating cond runs both branches for every lane:
                # the flag says whether this lane really fired.
                flag, arrays = arrays[0], arrays[1:]
                if not bool(np.asarray(flag)):
                    return
            step = int(np.asarray(step))
            if sample_every > 1 and step % sample_every:
                return
        except Exception as exc:  # noqa: BLE001 - totality
            guard.failed(exc)
            return
        offset = 0
        for part, (static, treedef, n, n_dyn) in zip(parts, layouts):
            mine, offset = arrays[offset:offset + n_dyn], offset + n_dyn
            try:
                it = iter(mine)
                leaves = [static[i] if i in static else _to_host(next(it)) for i in range(n)]
                value = jax.tree_util.tree_unflatten(treedef, leaves)
                part.deliver(TapEvent(part.path, step, value, part.total, part.kind, lane), part.top)
            except Exception as exc:  # noqa: BLE001 - totality
                guard.failed(exc)

    return host


def _lanes(host, axis_size, batched):
    """One host hop for every lane of a vmapped tap: split on the host."""

    def host_all(*arrays):
        arrays = [np.asarray(a) for a in arrays]
        for lane in range(axis_size):
            host(*[a[lane] if b else a for a, b in zip(arrays, batched)], lane=lane)

    return host_all


def hop(host, args, batched=True):
    """Stage one ``jax.debug.callback`` of ``host(*args)``.

    With ``batched``, under ``jax.vmap`` it stays ONE callback carrying every
    lane (the host splits them) instead of one callback per lane; forward-mode
    differentiation passes through it. Taps in code that reverse-mode
    differentiation may transpose use the plain callback instead.
    """
    if not batched:
        jax.debug.callback(host, *args)
        return

    @jax.custom_jvp
    @custom_vmap
    def _hop(*a):
        jax.debug.callback(host, *a)
        return ()

    @_hop.def_vmap
    def _hop_vmap(axis_size, in_batched, *a):
        jax.debug.callback(_lanes(host, axis_size, list(in_batched)), *a)
        return (), ()

    @_hop.defjvp
    def _hop_jvp(primals, tangents):
        return _hop(*primals), ()

    _hop(*args)


def emit(parts, guard, *, step, sample_every, valid=None, batched_hop=True):
    """Stage one host hop at ``step`` carrying every part.

    Gated on device by ``valid`` when given, else by ``step % sample_every
    == 0``. Each part's ``payload_fn()`` (the user's select) is only traced
    inside the gated branch, so steps that do not fire never run it. A carry
    tap and a y-tap of one loop share this one hop.
    """
    flagged = valid is not None

    def fire(step, *flag):
        operands, layouts = [], []
        for part in parts:
            dynamic, static, treedef, n = _split_payload(part.payload_fn())
            operands.extend(dynamic)
            layouts.append((static, treedef, n, len(dynamic)))
        host = make_host_fn(parts, layouts, guard, sample_every, flagged)
        hop(host, (step, *flag, *operands), batched_hop)

    if not flagged and sample_every == 1:
        fire(step)
        return

    def gated(step, *flag):
        fire(step, *flag)
        return ()

    if flagged:
        jax.lax.cond(valid, gated, lambda *_: (), step, valid)
    else:
        jax.lax.cond(step % sample_every == 0, gated, lambda *_: (), step)


def finite_flag(outs):
    """One bool on device: are all floating outputs finite?"""
    flags = [jnp.all(jnp.isfinite(o)) for o in outs if jnp.issubdtype(o.dtype, jnp.inexact)]
    if not flags:
        return jnp.bool_(True)
    out = flags[0]
    for f in flags[1:]:
        out = out & f
    return out
