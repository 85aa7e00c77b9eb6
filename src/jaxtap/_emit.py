"""Emission: the only module that creates host callbacks.

Everything that leaves the device goes through one host callback staged
here (:func:`_seam.host_callback`: ``jax.debug.callback``'s XLA custom call
without its per-call host cost). The device side runs the user's
``select`` (inside the sampled branch only) and ships the array leaves of
its result; the host side
(:mod:`._delivery`) rebuilds the pytree from host copies and hands a
:class:`TapEvent` to a sink.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from . import _seam
from ._host import warn_once_now
from ._delivery import _HERE, _deliver_column, _deliver_row, _is_column, make_buffer_host, make_host_fn
from ._delivery import byte_order, unpack as _unpack, unpack_plan as _unpack_plan


class _Mode(threading.local):
    """How the hops traced on this thread ship sharded values: gathered to
    one device (default), or one hop per shard (``per_shard``)."""

    per_shard = False


MODE = _Mode()


class shard_mode:
    """While tracing one plan's rewrite: its ``per_shard`` choice."""

    __slots__ = ("on", "prev")

    def __init__(self, plan):
        self.on = plan.per_shard

    def __enter__(self):
        self.prev, MODE.per_shard = MODE.per_shard, self.on

    def __exit__(self, *exc):
        MODE.per_shard = self.prev
        return False




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


class CarryLeaves(tuple):
    """What ``select`` receives with ``backward=True``: a tuple of leaves with
    ``.params``.

    In a backward loop: the cotangent of each forward carry leaf, in the
    forward carry's order (zeros where the backward pass carries none: a leaf
    that does not depend on what is differentiated, or an integer), and in
    ``.params`` the accumulated cotangents of the closed-over values the
    gradient flows to, in the order the loop body first uses them (the
    backward loop's own accumulators). In a forward loop: the carry leaves,
    and ``.params == ()``, so one select serves both directions.

    Examples
    --------
    >>> ct = CarryLeaves([1.0, 2.0], [0.5])
    >>> ct[0], ct.params
    (1.0, (0.5,))
    """

    def __new__(cls, leaves, params=()):
        self = tuple.__new__(cls, leaves)
        self.params = tuple(params)
        return self

    @property
    def carry(self) -> tuple:
        """The forward carry's cotangents (the tuple itself, as a plain tuple)."""
        return tuple(self)


# a select may return what it received: it crosses as its leaves and .params
jax.tree_util.register_pytree_node(
    CarryLeaves, lambda x: (tuple(x) + x.params, len(x)), lambda n, kids: CarryLeaves(kids[:n], kids[n:]))


LARGE_STEP = 256 * 1024  # bytes a default select may ship per step before jax-tap says so


def _warn_if_large(value, path, what):
    """The default select ships everything: say so, once per tap, when that
    is a lot per step (a solver's output buffer or a model's parameters in
    the carry: every step then copies it, and a recorder keeps each copy)."""
    size, largest = 0, (0, "")
    for x in jax.tree_util.tree_leaves(tuple(value) if what is not None else value):  # (what crosses: no .params)
        try:
            n = _nbytes(x)
        except Exception:  # noqa: BLE001 - an extended dtype (a PRNG key): its few words do not count
            continue
        size += n
        largest = max(largest, (n, f"{np.dtype(x.dtype).name}{list(np.shape(x))}"))
    if size >= LARGE_STEP:
        # (the largest leaf tells loops apart where a custom rule's body gives a provisional address)
        warn_once_now(f"jax-tap: the tap at {path!r} ships all its {what or 'output'} every step, "
                      f"{size / 1024:,.0f} KiB (no select given; largest leaf {largest[1]}), and a recorder "
                      "keeps every copy. Pass select= to ship what you watch (e.g. select=lambda leaves: "
                      "leaves[0], or a reduction), or leave this loop out (max_depth=, where=).")


def _nbytes(x) -> int:
    """Bytes of an array or abstract value (raises for an extended dtype)."""
    return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize


def run_select(select, select_path, leaves, path, what="carry leaves"):
    """Call the user's select on device values; explain failures clearly.

    ``leaves`` goes in as a tuple; with ``what=None`` it is one bare array
    (a primitive tap's ``output=k``) and goes in as it is.
    """
    value = leaves if what is None or type(leaves) is CarryLeaves else tuple(leaves)
    if select is None:
        _warn_if_large(value, path, what)
        return tuple(value) if what is not None else value
    try:
        if select_path == "keyword":
            out = select(value, path=path)
        elif select_path == "positional":
            out = select(value, path)
        else:
            out = select(value)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise TapSelectError(
            f"jax-tap: your `select` failed while tracing the tap at {path!r}: "
            f"{type(exc).__name__}: {exc}\n"
            f"select receives {'one array' if what is None else f'a tuple of the {what}'} (traced JAX "
            "values, so use jnp operations, not Python control flow on their values):\n"
            f"{_describe([leaves] if what is None else leaves)}"
        ) from None
    try:
        jax.tree_util.tree_flatten(out)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise TapSelectError(
            f"jax-tap: your `select` returned a value JAX cannot flatten at {path!r} "
            f"({type(exc).__name__}: {exc}): return arrays in tuples, lists, or dicts whose keys "
            "sort (all strings, or all numbers)."
        ) from None
    return out


def _split_payload(value):
    """Array leaves travel as operands; anything else is baked in statically."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    dynamic, static = [], {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, (jax.Array, _seam.Tracer, np.ndarray)) and leaf.dtype == jax.dtypes.float0:
            static[i] = np.zeros(leaf.shape, jax.dtypes.float0)  # (no data: nothing to carry)
        elif isinstance(leaf, (jax.Array, _seam.Tracer)):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
                leaf = jax.random.key_data(leaf)  # a PRNG key crosses (and is buffered) as its key data
            keep = MODE.per_shard or not isinstance(leaf, _seam.Tracer)  # per shard: the hop splits it
            dynamic.append(leaf if keep else _seam.replicated(leaf))
        elif isinstance(leaf, (np.ndarray, np.generic)):
            dynamic.append(jnp.asarray(leaf))
        else:
            static[i] = leaf
    return dynamic, static, treedef, len(leaves)


class Meta:
    """Where one event of a tap goes (the host side of one part of a hop)."""

    __slots__ = ("deliver", "path", "top", "total", "kind", "gated", "backward", "lanes")

    def __init__(self, deliver, path, top, total, kind, gated=False, backward=False, lanes=0):
        # deliver(event, top), host side; ``top`` (the top-level loop) only
        # matters to sinks that route, and those offer ``resolve`` as well
        self.deliver = deliver
        self.path = path
        self.top = top
        self.total = total
        self.kind = kind
        # gated: the payload is (fired?, value) and the event exists only if
        # it fired (a buffered tap inside a cond branch)
        self.gated = gated
        # backward: an event of a backward loop (cotangent taps), whose
        # counter k is the forward step total-1-k; its events say backward=True
        self.backward = backward
        # lanes: the value holds this many lanes along a leading axis, one
        # event each (a backward loop of a loop written under vmap)
        self.lanes = lanes

    def step_of(self, k):
        """The event step of counter value(s) ``k``."""
        return self.total - 1 - k if self.backward else k

    def origin(self):
        """The event tags of this meta in the hop being delivered."""
        tags = _HERE.tags
        return tags[:3] + (True,) if self.backward else tags


class Layout(NamedTuple):
    """How one payload value crosses: its ``n_dyn`` arrays travel, its other
    leaves (``static``: position -> value) stay on the host; ``treedef``
    rebuilds the ``count`` leaves."""

    static: dict
    treedef: Any
    count: int
    n_dyn: int

    @property
    def bare(self) -> bool:
        """One array and nothing else: delivered as it is, no tree."""
        return self.count == 1 and self.n_dyn == 1 and self.treedef.num_nodes == 1


class Block:
    """A whole inner scan's events, shipped as one payload of its enclosing
    buffered step: every sub-entry's values stacked over the scan's steps.

    The host expands it step by step, in execution order, into ordinary
    events (and nested blocks), so the inner loop needs no callback at all.
    """

    __slots__ = ("length", "metas", "layouts", "gated")

    def __init__(self, metas, layouts, length, gated=False):
        self.metas = list(metas)  # one step's entries (Meta or Block) ...
        self.layouts = list(layouts)  # ... and their Layouts
        self.length = length
        self.gated = gated  # its payload is (ran?, arrays): a scan in a cond branch

    def expand(self, arrays, lane, guard):
        """Deliver every step of ``arrays`` (host, one per value, steps leading)."""
        n = self.length
        if len(self.metas) == 1 and _is_column(self.metas[0], self.layouts[0]):
            _deliver_column(self.metas[0], guard, list(range(n)), arrays[0], n, lane)
            return
        for step in range(n):
            _deliver_row(self.metas, self.layouts, guard, step, arrays, step, lane)  # rows in execution order


def _split_all(values):
    """Flatten several payload values into operands plus host layouts."""
    operands, layouts = [], []
    for value in values:
        dynamic, static, treedef, n = _split_payload(value)
        operands.extend(dynamic)
        layouts.append(Layout(static, treedef, n, len(dynamic)))
    return operands, layouts


def _pack(args, by_dtype=None):
    """Every operand of a hop as bytes of ONE uint8 vector (traced).

    JAX moves each callback operand to the host separately, and that, not
    the bytes, dominates a hop's cost: one operand per hop is the cheapest.
    ``by_dtype`` (this JAX's way, see ``_seam.JOIN_BY_DTYPE``): the pieces
    of one dtype are joined first and bitcast once, widest dtypes first
    (:func:`_delivery.unpack_plan` places them the same way); otherwise each
    piece is bitcast on its own. Returns the vector and the layout the host
    needs to unpack it.
    """
    pieces, layout = [], []
    for a in args:
        a = jnp.asarray(a)
        kind = "plain"
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):  # PRNG keys ship their key data
            a, kind = jax.random.key_data(a), "keydata"
        if jnp.issubdtype(a.dtype, jnp.complexfloating):
            mine, kind = [jnp.real(a), jnp.imag(a)], "complex"
        elif a.dtype == jnp.bool_:
            mine, kind = [a.astype(jnp.uint8)], "bool"
        elif _sub_byte(a.dtype):  # int4, float4, ...: no bitcast to bytes; widen exactly
            wide = jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) else (
                jnp.int8 if jnp.issubdtype(a.dtype, jnp.signedinteger) else jnp.uint8)
            mine, kind = [a.astype(wide)], "narrow"
        else:
            mine = [a]
        layout.append((kind, np.dtype(a.dtype), tuple(a.shape), [np.dtype(p.dtype) for p in mine]))
        pieces.extend(p.reshape(-1) for p in mine)
    if not pieces:
        return jnp.zeros((0,), jnp.uint8), layout
    by_dtype = _seam.JOIN_BY_DTYPE if by_dtype is None else by_dtype
    if by_dtype:
        groups = {}
        for piece in pieces:
            groups.setdefault(np.dtype(piece.dtype), []).append(piece)
        pieces = [g[0] if len(g) == 1 else jnp.concatenate(g) for g in map(groups.get, byte_order(groups))]
    parts = [p if p.dtype == jnp.uint8 else _seam.to_bytes(p).reshape(-1) for p in pieces]
    return (parts[0] if len(parts) == 1 else jnp.concatenate(parts)), layout


def _sub_byte(dtype) -> bool:
    """A dtype narrower than a byte (int4, uint4, float4_e2m1fn, ...)."""
    for info in (jnp.iinfo, jnp.finfo):
        try:
            return info(dtype).bits < 8
        except (TypeError, ValueError):
            continue
    return False


def hop(host, args, batched=True, stage=None):
    """Stage one host callback of ``host(*args)``, packed into one operand.

    Under ``jax.vmap`` it stays ONE callback carrying every lane (the host
    unpacks once and splits the lanes) instead of one callback per lane.
    With ``batched`` that goes through ``custom_vmap`` (forward-mode
    differentiation passes through it); taps in code that reverse-mode
    differentiation may transpose (``batched=False``) use the host callback
    primitive's own batching instead, which transposes.
    """
    with _seam.tap_scope():
        origin = _seam.hop_origin()
        if MODE.per_shard and (origin is None or not origin.axes):
            if _seam.local_hop(args, lambda *local: hop(host, local, batched)):
                return  # sharded by their types: one hop per shard, inside a shard_map
            args = [_seam.replicated(a) for a in args]
        if origin is not None and origin.axes:  # inside shard_map: the shard travels too
            args = (_seam.shard_index(origin.axes), *args)
        packed, layout = _pack(args)
        plan = _unpack_plan(layout)

        raw = getattr(host, "raw", None) if origin is None else None
        raw_lanes = getattr(host, "raw_lanes", None) if origin is None else None

        def one(*parts):
            buf = _joined(parts)
            if raw is not None and raw(buf, plan):
                return  # kept as bytes by a recorder: unpacked when read
            _tagged(origin, _unpack(buf, plan), _one)

        def _one(arrays):
            host(*arrays)

        def lanes(*parts):
            buf = _joined(parts)
            if raw_lanes is not None and raw_lanes(np.asarray(buf), plan):
                return  # kept as bytes by a recorder, a row per lane
            _tagged(origin, _unpack(buf, plan), _lanes)  # (lanes, ...) each

        def _lanes(arrays):
            fast = getattr(host, "lanes", None)
            if fast is not None:
                fast(*arrays)
                return
            for lane in range(np.shape(arrays[0])[0] if arrays else 0):
                host(*[a[lane] for a in arrays], lane=lane)

        (stage or _stage_hop)(one, lanes, packed, batched)


def _tagged(origin, arrays, deliver):
    """Deliver a hop's host ``arrays`` with its origin tags set for the
    events built meanwhile (a sharded hop's first array is its shard)."""
    if origin is None:
        deliver(arrays)
        return
    shard = None
    if origin.axes:
        shard, arrays = int(np.asarray(arrays[0]).reshape(-1)[0]), arrays[1:]
    prev, _HERE.tags = _HERE.tags, origin.tags(shard) + (None,)
    try:
        deliver(arrays)
    finally:
        _HERE.tags = prev


# Bytes per callback operand. XLA's CPU client copies an operand over 100 KiB
# to the host asynchronously, on a thread pool that device threads waiting in
# callbacks can exhaust: with more devices than cores (shard_map on CPU) a
# large hop would deadlock. Smaller operands are copied on the spot.
_CHUNK = 96 << 10


def _chunks(a) -> tuple:
    """A packed (traced) vector as operands of at most ``_CHUNK`` bytes,
    split along its last axis (leading axes: lanes)."""
    rows = int(np.prod(a.shape[:-1], dtype=np.int64)) or 1
    per, n = _CHUNK // rows, a.shape[-1]
    if n <= per or not per:  # (not per: so many lanes that even one byte column passes the limit; one
        return (a,)          # operand then, not one per byte, each as large and as slow to copy)
    return tuple(jax.lax.slice_in_dim(a, i, min(i + per, n), axis=a.ndim - 1) for i in range(0, n, per))


def _joined(parts):
    """Host side of :func:`_chunks`."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([np.asarray(p) for p in parts], axis=-1)


def _stage_hop(one, lanes, packed, batched):
    if not batched:
        def all_lanes(*parts):  # vmapped later: still one callback, carrying every lane
            if parts[0].shape[0]:  # (a vmap over no lanes: nothing to send)
                _seam.host_callback(lanes, *_chunks(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)))

        _seam.host_callback(one, *_chunks(packed), on_batch=all_lanes)
        return

    @jax.custom_jvp
    @custom_vmap
    def _hop(a):
        _seam.host_callback(one, *_chunks(a))
        return ()

    @_hop.def_vmap
    def _hop_vmap(axis_size, in_batched, a):
        if axis_size:  # (a vmap over no lanes: nothing to send)
            _seam.host_callback(lanes if in_batched[0] else one, *_chunks(a))
        return (), ()

    @_hop.defjvp
    def _hop_jvp(primals, tangents):
        return _hop(*primals), ()

    _hop(packed)


# warn_where's staging: the same as a hop's, named apart so that counting event hops leaves it out
_stage_check = _stage_hop


def emit(metas, payloads, guard, *, step, sample_every, when=None, batched_hop=True, gate_on_host=False):
    """Stage one host hop at ``step`` carrying one event per meta.

    Gated on device by ``when`` if given, else by ``step % sample_every
    == 0``. ``payloads()`` (the users' selects) is only traced inside the
    gated branch, so steps that do not fire never run it. A carry tap and a
    y-tap of one loop share this one hop. ``gate_on_host``: ``when`` is
    true wherever the hop runs unbatched, so it travels as the hop's flag
    and the host drops the lanes where it is false, with no ``cond`` to
    compile (under vmap a cond on a batched flag runs both branches anyway).
    """
    conditional = when is not None

    def fire(step, *flag):
        operands, layouts = _split_all(payloads())
        host = make_host_fn(metas, layouts, guard, sample_every, conditional)
        hop(host, (step, *flag, *operands), batched_hop)

    if not conditional and sample_every == 1:
        fire(step)
        return

    def gated(step, *flag):
        fire(step, *flag)
        return ()

    if conditional and gate_on_host:
        fire(step, when)
        return
    with _seam.tap_scope():
        if conditional:
            jax.lax.cond(when, gated, lambda *_: (), step, when)
        else:
            jax.lax.cond(step % sample_every == 0, gated, lambda *_: (), step)


class Buffer:
    """Device-side buffering of ``capacity`` sampled steps per host hop.

    The loop's driver writes each sampled step's payloads into fixed-size
    buffers carried by an effect-free loop, and :meth:`flush` ships them in
    one callback; the host delivers ordinary TapEvents, one per row, in step
    order.
    """

    def __init__(self, metas, payloads, observe, capacity, guard):
        self.metas, self.payloads, self.observe = metas, payloads, observe
        self.capacity, self.guard = capacity, guard
        self.layouts, self.shapes = None, None

    def _dynamic(self, last, state):
        operands, layouts = _split_all(self.payloads(*self.observe(last, state)))
        self.layouts = layouts
        return operands

    def prepare(self, state, run_one=None):
        """Size the buffers from the loop's ``state``. With explicit sharding
        types the values written come from the state after a step, whose
        types can differ from the initial one's (a scalar started on no
        mesh, updated from sharded values): ``run_one(state)`` runs a step."""
        specs = [_seam.spec_of(_seam.abstractify(x)) for x in state]
        if run_one is not None and _seam.typed_sharding(specs):
            specs = jax.eval_shape(lambda *st: list(run_one(list(st))), *specs)
        self.shapes = jax.eval_shape(lambda *st: self._dynamic(np.int32(0), list(st)), *specs)

    def row_bytes(self):
        """Device bytes one buffered step takes (its step number included)."""
        return 4 + sum(_nbytes(s) for s in self.shapes)

    def empty(self, spare=True):
        # one row more than the capacity: where a step did not fire, its row
        # is written there, past every row a flush delivers (not needed when
        # every write fires: an inner scan's block)
        rows = self.capacity + int(spare)
        bufs = [_seam.varying_like(jnp.zeros((rows, *s.shape), s.dtype), s) for s in self.shapes]
        return [jnp.zeros((rows,), jnp.int32), *bufs]

    def write(self, fired, j, step, state, bufs):
        """Write a step's row at ``j``; where ``fired`` is false, into the
        spare row, ``j`` unchanged. Never a ``cond`` around the write: XLA
        copies buffers into and out of a conditional, and under ``vmap`` a
        batched one selects between whole buffers, every step."""
        at = j if fired is None else jax.lax.select(fired, j, np.int32(self.capacity))
        values = self._dynamic(step, state)
        steps = _seam.update_index_in_dim(bufs[0], step, at)
        bufs = [_seam.update_index_in_dim(b, v, at) for b, v in zip(bufs[1:], values)]
        grown = np.int32(1) if fired is None else jax.lax.convert_element_type(fired, np.int32)
        return jax.lax.add(j, grown), [steps, *bufs]

    def flush(self, count, bufs):
        host = make_buffer_host(self.metas, self.layouts, self.guard)

        def ship(count, *bufs):
            hop(host, (count, *bufs))
            return ()

        with _seam.tap_scope():
            jax.lax.cond(jax.lax.gt(count, np.int32(0)), ship, lambda *_: (), count, *bufs)


def warn_where(flag, message):
    """Warn ``message`` (once) where the traced ``flag`` is true at run time."""
    def host(fired, lane=None):
        if np.asarray(fired).any():
            warn_once_now(message)

    host.lanes = host  # (every lane's flag at once)

    def fire(f):
        hop(host, (f,), stage=_stage_check)  # (one callback for every lane; not an event hop)
        return ()

    with _seam.tap_scope():
        jax.lax.cond(flag, fire, lambda f: (), flag)


def finite_flag(outs):
    """One bool on device: are all floating outputs finite?"""
    flags = [jnp.all(jnp.isfinite(o)) for o in outs if _seam.is_inexact(getattr(o, "dtype", None))]
    if not flags:
        return jnp.bool_(True)
    out = flags[0]
    for f in flags[1:]:
        out = out & f
    return out
