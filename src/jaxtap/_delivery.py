"""Delivery: the host half of a hop, from host arrays to events and consumers.

Emission (``_emit``) traces what a hop ships and creates the callback; the
callback's host side, defined here, rebuilds each payload from host copies
(one event per row of a buffer, or a :class:`TapBlock` of columns for the
consumers that take them) and hands it to its sink, never raising.
"""
from __future__ import annotations

import collections
import itertools
import threading

import jax
import numpy as np

from . import _seam
from ._blocks import TapBlock, column_block
from ._event import NO_ORIGIN, TapEvent, make_event
from ._host import Guard

_tuple_new = tuple.__new__


class _Here(threading.local):
    """The origin tags ``(shard, device, process, None)`` of the hop being
    delivered on this thread (device threads call back concurrently)."""

    tags = NO_ORIGIN


_HERE = _Here()


def byte_order(dtypes):
    """The order of dtype groups in a buffer packed by dtype (``_emit._pack``):
    widest first, then as first met, so every piece's view is aligned."""
    seen = list(dict.fromkeys(dtypes))
    return sorted(seen, key=lambda d: (-d.itemsize, seen.index(d)))


def unpack_plan(layout, by_dtype=None):
    """Byte ranges of every piece in a packed buffer (computed once per hop
    site), and whether a piece's view needs a reshape (not one axis).
    Pieces lie in order or, ``by_dtype`` (this JAX's way, see
    ``_seam.JOIN_BY_DTYPE``), those of one dtype together, groups in
    :func:`byte_order`."""
    by_dtype = _seam.JOIN_BY_DTYPE if by_dtype is None else by_dtype
    sizes = [int(np.prod(shape, dtype=np.int64)) * pd.itemsize for _, _, shape, pds in layout for pd in pds]
    dtypes = [pd for _, _, _, pds in layout for pd in pds]
    keys = dtypes if by_dtype else list(range(len(dtypes)))
    total = {}
    for key, n in zip(keys, sizes):
        total[key] = total.get(key, 0) + n
    start, offset = {}, 0
    for key in (byte_order(total) if by_dtype else total):
        start[key], offset = offset, offset + total[key]
    plan, it = [], iter(zip(keys, sizes))
    for kind, dtype, shape, piece_dtypes in layout:
        pieces = []
        for pd in piece_dtypes:
            key, n = next(it)
            pieces.append((start[key], start[key] + n, pd))
            start[key] += n
        plan.append((kind, dtype, shape, pieces, len(shape) != 1))
    return plan


def unpack(buf, plan):
    """Host side of ``_emit._pack``: numpy views into one host buffer.

    ``buf`` may carry leading batch (lane) dimensions; they lead every output.
    """
    buf = np.asarray(buf)
    lead = buf.shape[:-1]
    out = []
    for kind, dtype, shape, pieces, reshape in plan:
        if kind == "plain" and not lead:  # the hot path: one view, one axis needs no reshape
            a, b, pd = pieces[0]
            view = buf[a:b].view(pd)
            out.append(view.reshape(shape) if reshape else view)
            continue
        if lead:  # a lane's bytes are not contiguous across lanes: copy
            arrays = [np.ascontiguousarray(buf[..., a:b]).view(pd).reshape(lead + shape) for a, b, pd in pieces]
        else:
            arrays = [buf[a:b].view(pd).reshape(shape) for a, b, pd in pieces]
        if kind == "complex":
            value = np.empty(lead + shape, dtype)
            value.real, value.imag = arrays
        elif kind == "bool":
            value = arrays[0].astype(bool)
        elif kind == "narrow":
            value = arrays[0].astype(dtype)
        else:
            value = arrays[0]
        out.append(value)
    return out


def _is_block(meta) -> bool:
    """A whole inner scan's events (``_emit.Block``) rather than one event."""
    return hasattr(meta, "expand")


def _to_host(x):
    a = np.array(x, copy=True)
    return a[()] if a.ndim == 0 else a


def _is_column(meta, layout) -> bool:
    """One bare array a step for an ungated event: the hot path."""
    return layout.bare and not _is_block(meta) and not meta.gated and not meta.lanes


def _deliver_row(metas, layouts, guard, step, arrays, row, lane):
    """Rebuild and deliver each meta's event from host arrays (``row`` of a buffer)."""
    offset = 0
    for meta, layout in zip(metas, layouts):
        mine, offset = arrays[offset:offset + layout.n_dyn], offset + layout.n_dyn
        static = layout.static
        try:
            if layout.bare and not _is_block(meta):
                value = _own(mine[0] if row is None else mine[0][row])  # a bare array: no tree
            else:
                it = iter(mine)
                leaves = [static[i] if i in static else _own(next(it) if row is None else next(it)[row])
                          for i in range(layout.count)]
                if _is_block(meta):
                    if meta.gated:  # a scan inside a cond branch: did the branch run?
                        fired, leaves = leaves[0], leaves[1:]
                        if not fired:
                            continue
                    meta.expand(leaves, lane, guard)
                    continue
                value = jax.tree_util.tree_unflatten(layout.treedef, leaves)
            if meta.gated:
                fired, value = value
                if not fired:
                    continue
            if meta.lanes:
                _deliver_lanes(meta, step, value)
                continue
            meta.deliver(make_event(meta.path, meta.step_of(step), value, meta.total, meta.kind, lane, meta.origin()),
                         meta.top)
        except Exception as exc:  # noqa: BLE001 - totality
            guard.failed(exc)


def _deliver_lanes(meta, step, value):
    """One event per lane of a value whose leaves lead with the lane axis."""
    step, origin = meta.step_of(step), meta.origin()
    for i in range(meta.lanes):
        one = jax.tree_util.tree_map(lambda a: _own(a[i]) if isinstance(a, np.ndarray) and a.ndim else a, value)
        meta.deliver(make_event(meta.path, step, one, meta.total, meta.kind, i, origin), meta.top)


def _deliver_column(meta, guard, steps, column, count, lane, rows_are_lanes=False):
    """Deliver ``count`` rows of one bare array (a buffer's steps, or a vmapped
    hop's lanes): the hot path.

    A sink may offer ``resolve(path, kind, top) -> (fn, path) | None`` to route
    a whole batch once (the with-form's block lookup and renaming); then
    ``fn(event)`` receives each event.
    """
    target = _resolve(meta, guard)
    if target is None:
        return
    deliver, path = target
    total, kind, origin = meta.total, meta.kind, meta.origin()
    shard, device, process, backward = origin
    if meta.backward:
        steps = meta.step_of(np.asarray(steps[:count]))
    columns = getattr(deliver, "columns", None)
    if columns is not None and not rows_are_lanes:  # the consumers take columns: no objects
        if not count:
            return
        try:
            columns(TapBlock.of_column(path, kind, total, lane, np.array(steps[:count]), np.array(column[:count]),
                                       origin))
        except Exception as exc:  # noqa: BLE001 - totality
            guard.failed(exc)
        return
    if isinstance(steps, np.ndarray):
        steps = steps.tolist()
    failed = guard.failed
    if isinstance(deliver, Guard):  # a lone on_step: call it directly, guard the whole loop
        deliver, failed = deliver.fn, deliver.failed
    lanes = range(count) if rows_are_lanes else None
    # Rows of a 1-d column are fresh numpy scalars; rows of a wider one are
    # views that must not keep the hop's buffer alive: a buffer's rows are
    # copied one by one (an event must not pin a K-row block), a hop's lanes
    # share one copy (a few rows).
    if np.ndim(column) == 1:
        rows = column[:count]
    elif rows_are_lanes:
        rows = list(np.array(column[:count]))
    else:
        rows = [_own(r) for r in column[:count]]
    done = 0
    while done < count:
        try:
            for step, value, ln in zip(steps[done:count], rows[done:], lanes[done:] if lanes is not None
                                       else itertools.repeat(lane, count - done)):
                done += 1
                deliver(_tuple_new(TapEvent, (path, step, value, total, kind, ln, shard, device, process, backward)))
        except BaseException as exc:  # noqa: BLE001 - totality, as Guard
            failed(exc)


def _lane_events(meta, layout, guard, step, arrays, conditional, sample_every):
    """Each lane's event of a vmapped hop of one value, built from the
    lanes' columns at once (:meth:`TapBlock._build`, as a recorder reads
    them) and delivered lane after lane: the events per-lane delivery
    builds one by one, for a fraction of its host work."""
    target = _resolve(meta, guard)
    if target is None:
        return
    deliver, path = target
    try:
        step, keep = np.asarray(step), None
        if conditional:  # the flag: which lanes really fired
            keep, arrays = np.asarray(arrays[0]).astype(bool), arrays[1:]
        if sample_every > 1:
            keep = (step % sample_every == 0) & (True if keep is None else keep)
        lanes = np.arange(len(step)) if keep is None else np.flatnonzero(keep)
        cols = [np.asarray(a) if keep is None else np.asarray(a)[lanes] for a in arrays]
        steps = step if keep is None else step[lanes]
        events = _lanes_block(meta, layout, path, steps, cols, lanes)._build() if len(lanes) else []
    except Exception as exc:  # noqa: BLE001 - totality
        guard.failed(exc)
        return
    _deliver_all(deliver, guard, events)


def _lanes_block(meta, layout, path, steps, cols, lanes) -> TapBlock:
    """A block of rows from many lanes (``lanes``: each row's), as columns."""
    if layout.bare:
        return TapBlock(path, meta.kind, meta.total, None, steps, cols[0], lanes=lanes, origin=meta.origin())
    return TapBlock(path, meta.kind, meta.total, None, steps, leaves=cols, treedef=layout.treedef,
                    static=layout.static, count=layout.count, lanes=lanes, origin=meta.origin())


def _deliver_all(deliver, guard, events) -> None:
    """Hand ``events`` to ``deliver`` in order; a failing consumer is warned
    about (once) and the rest still go."""
    failed = guard.failed
    if isinstance(deliver, Guard):  # a lone on_step: call it directly, guard the whole loop
        deliver, failed = deliver.fn, deliver.failed
    done = 0
    while done < len(events):
        try:
            for event in events[done:]:
                done += 1
                deliver(event)
        except BaseException as exc:  # noqa: BLE001 - totality, as Guard
            failed(exc)


def _resolve(meta, guard):
    """(deliver, path) of a meta's batch: a sink may offer ``resolve(path,
    kind, top) -> (fn, path) | None`` to route a whole batch once (the
    with-form's block lookup and renaming). None: drop the batch."""
    resolve = getattr(meta.deliver, "resolve", None)
    if resolve is None:
        return meta.deliver, meta.path
    try:
        return resolve(meta.path, meta.kind, meta.top)
    except Exception as exc:  # noqa: BLE001 - totality
        guard.failed(exc)
        return None


def _deliver_tree_block(meta, layout, guard, steps, arrays, count, lane, rebuild) -> bool:
    """One meta's buffered rows as a TapBlock, when its consumers take
    columns; False when they want events (the caller delivers rows).
    ``rebuild``: build its events now (see :func:`_rebuilt_here`)."""
    if meta.lanes:
        return False  # one event per lane: the rows, one by one
    target = _resolve(meta, guard)
    if target is None:
        return True
    columns = getattr(target[0], "columns", None)
    if columns is None:
        return False
    if not count:
        return True
    try:
        steps = meta.step_of(np.asarray(steps[:count])) if meta.backward else steps
        columns(_rebuilt_here(column_block(target[1], meta.kind, meta.total, lane, steps, arrays, layout, count,
                                           meta.origin()), rebuild))
    except Exception as exc:  # noqa: BLE001 - totality
        guard.failed(exc)
    return True


def _own(x):
    """A small host copy that keeps no larger buffer alive (0-d -> numpy scalar)."""
    if isinstance(x, np.generic):
        return x
    if isinstance(x, np.ndarray):
        return x[()] if x.ndim == 0 else x.copy()
    return _to_host(x)


def make_host_fn(metas, layouts, guard: Guard, sample_every, conditional=False):
    """The host half of a per-step hop: rebuild each event, never raising.

    Returns ``host(step, [flag], *arrays, lane=None)``.
    """

    meta = metas[0]
    one_value = len(metas) == 1 and not _is_block(meta) and not meta.gated and not meta.lanes and not meta.backward

    def lanes(step, *arrays):
        """Every lane of a vmapped hop: each array has a leading lane axis."""
        if one_value and np.ndim(step) == 1:
            if layouts[0].bare and not conditional and sample_every == 1:  # the leanest: rows as they are
                _deliver_column(meta, guard, step.tolist(), arrays[0], len(step), None, rows_are_lanes=True)
            else:
                _lane_events(meta, layouts[0], guard, step, arrays, conditional, sample_every)
            return
        for lane in range(len(step)):
            host(step[lane], *[a[lane] for a in arrays], lane=lane)

    def host(step, *arrays, lane=None):
        try:
            if conditional:
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
        _deliver_row(metas, layouts, guard, step, arrays, None, lane)

    host.lanes = lanes
    if one_value and (layouts[0].bare or _pure_tree(layouts[0].treedef)):
        if not layouts[0].bare:  # (one bare array: as cheap per event, and smaller)
            host.raw = _kept_rows(meta, layouts[0], guard, sample_every, conditional)
        host.raw_lanes = _kept_lanes(meta, layouts[0], guard, sample_every, conditional)
    return host


def _rebuilt_here(block, rebuild):
    """``block``, its events built now when ``rebuild`` (rebuilding its value
    runs user code, see :func:`_pure_tree`): a recorder then holds them as a
    hop builds them, rather than building them where it is read."""
    if rebuild:
        block._materialized()
    return block


_PURE_NODES = (tuple, list, dict, type(None), collections.OrderedDict, collections.defaultdict)


def _pure_tree(treedef) -> bool:
    """Whether rebuilding ``treedef`` runs no user code: only built-in
    containers (and namedtuples). A custom node's unflatten may call JAX
    (``jnp.asarray`` in an ``__init__``): kept bytes would run it when the
    recorder is read, on the reader's thread, device and trace (a tracer
    inside ``jit``), not in the hop as per-event delivery does."""
    try:
        data = treedef.node_data()
        if data is not None:
            kind = data[0]
            if kind not in _PURE_NODES and not _plain_namedtuple(kind):
                return False
        return all(_pure_tree(c) for c in treedef.children())
    except Exception:  # noqa: BLE001 - an unknown treedef: events as they come
        return False


def _plain_namedtuple(kind) -> bool:
    """A namedtuple class whose construction runs no user code: ``__new__``
    as ``collections.namedtuple`` (or ``typing.NamedTuple``) wrote it, no
    ``__init__`` of its own (a subclass may call JAX in either, and JAX
    rebuilds a namedtuple by calling its class)."""
    if not (issubclass(kind, tuple) and hasattr(kind, "_fields")):
        return False
    new = next(c for c in kind.__mro__ if "__new__" in c.__dict__)
    init = next(c for c in kind.__mro__ if "__init__" in c.__dict__)
    return "_fields" in new.__dict__ and init in (tuple, object)


def _kept_rows(meta, layout, guard, sample_every, conditional):
    """``raw(buf, plan) -> handled?``: a hop's packed bytes kept as they are
    (one copy into the recorder's run of such events, ``_blocks.RawRun``)
    when its consumers are a recorder alone (``sink.keep_bytes``): a carry
    of many leaves then costs its recorder one copy, not an array per leaf
    nor an object per event. The events are built, the same as per-event
    delivery's, when the recorder is read."""
    decoder = _decoder_cache(layout, conditional)

    def raw(buf, plan):
        if conditional and not buf[plan[1][3][0][0]]:
            return True  # the flag: this lane did not fire
        if sample_every > 1:
            a, b, pd = plan[0][3][0]
            if int(buf[a:b].view(pd)[0]) % sample_every:
                return True
        target = _resolve(meta, guard)
        if target is None:
            return True  # no receiver: dropped
        keep = getattr(target[0], "keep_bytes", None)
        if keep is None:
            return False
        try:
            keep(target[1], meta.kind, meta.total, buf if buf.flags.c_contiguous else buf.tobytes(), decoder(plan))
        except Exception as exc:  # noqa: BLE001 - totality
            guard.failed(exc)
        return True

    return raw


def _kept_lanes(meta, layout, guard, sample_every, conditional):
    """``raw(buf, plan) -> handled?`` for a vmapped hop (``buf``: one row of
    packed bytes per lane): as :func:`_kept_rows`, the lanes that fire kept
    as one :meth:`TapBlock.of_bytes` of one row (event) per lane, in lane
    order. A wide ``vmap`` then costs its recorder one copy per hop, not
    an event per lane."""
    decoder = _decoder_cache(layout, conditional)

    def raw(buf, plan):
        if buf.ndim != 2:
            return False  # lanes of nested vmaps: one by one
        target = _resolve(meta, guard)
        if target is None:
            return True
        rows = getattr(target[0], "raw_rows", None)
        if rows is None:
            return False
        try:
            keep = np.ones(len(buf), bool)
            if conditional:  # the flag: which lanes fired
                keep &= buf[:, plan[1][3][0][0]] != 0
            if sample_every > 1:
                a, b, pd = plan[0][3][0]
                keep &= np.ascontiguousarray(buf[:, a:b]).view(pd)[:, 0] % sample_every == 0
            lanes = np.flatnonzero(keep)
            if not len(lanes):
                return True
            kept = buf if len(lanes) == len(buf) else buf[lanes]
            rows(TapBlock.of_bytes(target[1], meta.kind, meta.total, kept.tobytes(), decoder(plan), lanes=lanes))
        except Exception as exc:  # noqa: BLE001 - totality
            guard.failed(exc)
        return True

    return raw


def _decoder_cache(layout, conditional):
    """``decoder(plan)``: :func:`_decoder` of a hop's plan, made once per plan."""
    decoders = {}
    skip = 2 if conditional else 1  # the step, and the gating flag: not the value's

    def decoder(plan):
        decode = decoders.get(id(plan))
        if decode is None:
            decode = decoders[id(plan)] = _decoder(plan, layout, skip)
        return decode

    return decoder


def _decoder(plan, layout, skip):
    """``decode(rows)`` of :meth:`TapBlock.of_bytes`: the step column and the
    value's leaf columns of stacked hop buffers ``(step, [flag], *leaves)``."""
    def decode(rows):
        arrays = unpack(rows, plan)
        if layout.bare:
            return arrays[0], arrays[skip:], None, {}, 1
        return arrays[0], arrays[skip:], layout.treedef, layout.static, layout.count

    return decode


def make_buffer_host(metas, layouts, guard: Guard):
    """The host half of a buffered hop: ``count`` rows, delivered in order."""

    column = len(metas) == 1 and _is_column(metas[0], layouts[0])
    # one meta's value rebuilt through user code: its blocks build their events in the hop
    rebuild = len(metas) == 1 and not layouts[0].bare and not _pure_tree(layouts[0].treedef)

    def host(count, steps, *arrays, lane=None):
        try:
            count = int(count)
            steps = np.asarray(steps)[:count]
            arrays = [np.asarray(a) for a in arrays]  # one host view per buffer per hop
        except Exception as exc:  # noqa: BLE001
            guard.failed(exc)
            return
        if column:
            _deliver_column(metas[0], guard, steps, arrays[0], count, lane)  # the common case: a tight loop
            return
        if len(metas) == 1 and not _is_block(metas[0]) and not metas[0].gated:
            if _deliver_tree_block(metas[0], layouts[0], guard, steps, arrays, count, lane, rebuild):
                return
        steps = steps.tolist()
        for row in range(count):
            _deliver_row(metas, layouts, guard, steps[row], arrays, row, lane)

    def lanes(count, steps, *arrays):
        """Every lane of a vmapped buffered hop (each array: lanes, rows, ...)."""
        if len(metas) == 1 and _buffered_lanes(metas[0], layouts[0], guard, count, steps, arrays, rebuild):
            return
        for lane in range(np.shape(count)[0]):
            host(count[lane], steps[lane], *[a[lane] for a in arrays], lane=lane)

    host.lanes = lanes
    return host


def _buffered_lanes(meta, layout, guard, counts, steps, arrays, rebuild) -> bool:
    """Every lane's rows of a vmapped buffered hop, lane after lane (the
    order lane-by-lane delivery gives): ONE block for a recorder alone
    (``sink.raw_rows``), events built at once for consumers of events;
    False when the rows must go lane by lane (consumers of blocks get one
    block per lane)."""
    if _is_block(meta) or meta.gated or meta.lanes or meta.backward or np.ndim(counts) != 1:
        return False
    target = _resolve(meta, guard)
    if target is None:
        return True
    rows = getattr(target[0], "raw_rows", None)
    if rows is None and getattr(target[0], "columns", None) is not None:
        return False
    try:
        counts, steps = np.asarray(counts).astype(np.int64), np.asarray(steps)
        fired = np.arange(steps.shape[1]) < counts[:, None]
        lanes = np.repeat(np.arange(len(counts)), counts)
        if not len(lanes):
            return True
        cols = [np.asarray(a)[fired] for a in arrays]  # (boolean indexing copies)
        block = _lanes_block(meta, layout, target[1], steps[fired], cols, lanes)
        if rows is not None:
            rows(_rebuilt_here(block, rebuild))
            return True
        events = block._build()
    except Exception as exc:  # noqa: BLE001 - totality
        guard.failed(exc)
        return True
    _deliver_all(target[0], guard, events)
    return True
