"""Columnar delivery: a buffered hop's rows as columns (:class:`TapBlock`).

A buffered loop ships K steps in one host hop. When every consumer of a
loop's events can take them as columns (the recorder, ``JSONLWriter``, the
CLI, an ``on_step`` with an ``on_block`` method), the hop hands over one
``TapBlock`` instead of K ``TapEvent`` objects: the step numbers as one
array and each value leaf as one array whose first axis is the row. Objects
are built only when someone asks (``FlightRecorder.events``,
``TapBlock.events()``), with the same contents and order as per-event
delivery.
"""
from __future__ import annotations

import array
import itertools
from typing import Any, List, Optional

import jax
import numpy as np

from ._event import NO_ORIGIN, TapEvent, make_event


class TapBlock:
    """Consecutive events of one address, as columns.

    Attributes
    ----------
    path, kind, total, lane
        As on every :class:`TapEvent` of the block.
    lanes : numpy.ndarray or None
        Each row's lane (int), for a block of the lanes of one vmapped hop
        (only a recorder receives such blocks); None when every row's lane
        is ``lane``.
    origin : tuple
        ``(shard, device, process)`` of every event of the block (see
        :class:`TapEvent`); ``(None, None, None)`` on one device.
    steps : numpy.ndarray
        The events' ``step`` values (int), in delivery order.
    values
        The events' ``value`` with every array leaf stacked along a new
        first axis (one row per event): what ``select`` returned, as columns.

    Examples
    --------
    >>> import numpy as np
    >>> b = TapBlock("scan[0]", "carry", 3, None, np.arange(3), np.array([0.5, 1.5, 2.5], np.float32))
    >>> len(b), b.events()[1]
    (3, TapEvent(path='scan[0]', step=1, value=np.float32(1.5), total=3, kind='carry'))
    """

    __slots__ = ("path", "kind", "total", "lane", "origin", "_steps", "_cols", "_treedef", "_static", "_count",
                 "_events", "_raw", "_lanes")

    def __init__(self, path, kind, total, lane, steps, values=None, *, leaves=None, treedef=None, static=None,
                 count=None, origin=NO_ORIGIN, lanes=None):
        self.path, self.kind, self.total, self.lane, self.origin = path, kind, total, lane, tuple(origin)
        self._lanes = None if lanes is None else _frozen(np.asarray(lanes))
        self._steps = _frozen(np.asarray(steps))
        if leaves is None:  # a bare column
            leaves, treedef, static, count = [values], None, {}, 1
        leaves = [_frozen(np.asarray(c)) for c in leaves]  # shared by every consumer: read-only
        self._cols, self._treedef, self._static, self._count = leaves, treedef, static or {}, count
        self._events = self._raw = None

    @classmethod
    def of_column(cls, path, kind, total, lane, steps, column, origin) -> "TapBlock":
        """A bare column from fresh host copies (the hot path: made
        read-only in place, no conversion)."""
        self = cls.__new__(cls)
        steps.flags.writeable = column.flags.writeable = False
        self.path, self.kind, self.total, self.lane, self.origin = path, kind, total, lane, origin
        self._steps, self._cols, self._treedef, self._static, self._count = steps, [column], None, {}, 1
        self._events = self._raw = self._lanes = None
        return self

    @classmethod
    def of_bytes(cls, path, kind, total, raw, decode, lanes=None) -> "TapBlock":
        """One event kept as the bytes its hop brought (``raw``, a copy):
        ``decode(raws)`` turns a stack of such rows (2-d uint8, one row
        per event) into ``(steps, leaves, treedef, static, count)``, and
        runs only when someone reads the block (the unbuffered hot path of
        a recorder: a carry of many leaves costs one copy, not one array
        per leaf). With ``lanes`` (each row's lane), ``raw`` holds the rows
        of a vmapped hop's lanes, one event each."""
        self = cls.__new__(cls)
        self.path, self.kind, self.total, self.lane, self.origin = path, kind, total, None, NO_ORIGIN
        self._steps = self._cols = self._events = None
        self._treedef, self._static, self._count = None, {}, 1
        self._raw = (raw, decode)
        self._lanes = None if lanes is None else _frozen(lanes)
        return self

    @property
    def lanes(self) -> Optional[np.ndarray]:
        """Each row's lane, or None when every row's is ``lane``."""
        return self._lanes

    @property
    def steps(self) -> np.ndarray:
        """The events' ``step`` values (int), in delivery order."""
        if self._steps is None:
            self._decode()
        return self._steps

    @property
    def _leaves(self) -> list:
        if self._cols is None:
            self._decode()
        return self._cols

    def _decode(self):
        kept = self._raw
        if kept is None:
            return  # lanes decoded meanwhile on another thread (their columns are set first)
        raw, decode = kept
        if self._lanes is not None:
            _decode_lanes(decode, [(self, raw)])
            return
        if raw is None:  # its event is built and its bytes are gone: the event's leaves, as one row
            self._cols = [_frozen(np.asarray(v)[None]) for v in self._event_leaves()]
            return
        steps, leaves, treedef, static, count = decode(np.frombuffer(raw, np.uint8).reshape(len(self), -1))
        self._treedef, self._static, self._count = treedef, static or {}, count
        self._cols = [_frozen(c) for c in leaves]
        self._steps = _frozen(steps)  # last: a reader on another thread waits on it

    def __len__(self) -> int:
        if self._steps is None:
            return 1 if self._lanes is None else len(self._lanes)
        return len(self._steps)

    def __repr__(self) -> str:
        return f"TapBlock(path={self.path!r}, kind={self.kind!r}, {len(self)} events)"

    @property
    def values(self) -> Any:
        """The value pytree with column leaves (static leaves as they are)."""
        return self._unflatten(self._leaves)

    def _unflatten(self, arrays):
        if self._treedef is None:
            return arrays[0]
        it = iter(arrays)
        return jax.tree_util.tree_unflatten(self._treedef, [self._static[i] if i in self._static else next(it)
                                                            for i in range(self._count)])

    def events(self) -> List[TapEvent]:
        """The block as TapEvents (what per-event delivery would have given;
        built once, then kept)."""
        return list(self._materialized())

    def _materialized(self) -> List[TapEvent]:
        if self._events is None:
            raw = self._raw
            if raw is not None and raw[0] is not None:
                decode_kept([self])  # sets _events and lets the bytes go
            if self._events is None:
                self._events = self._build()
        return self._events

    def _build(self) -> List[TapEvent]:
        rows = [_rows(c) for c in self._leaves]
        path, kind, total, origin = self.path, self.kind, self.total, self.origin
        steps = self.steps.tolist()
        lanes = itertools.repeat(self.lane) if self._lanes is None else self._lanes.tolist()
        if self._treedef is None:
            return [make_event(path, s, v, total, kind, ln, origin) for s, v, ln in zip(steps, rows[0], lanes)]
        if rows and not self._static:  # every leaf a column: one C-level unflatten per event
            unflatten = self._treedef.unflatten
            return [make_event(path, s, unflatten(v), total, kind, ln, origin)
                    for s, v, ln in zip(steps, zip(*rows), lanes)]
        return [make_event(path, s, self._unflatten([r[i] for r in rows]), total, kind, ln, origin)
                for i, (s, ln) in enumerate(zip(steps, lanes))]

    def _settle(self, event, steps, treedef, static, count):
        """A kept block, once its ``event`` is built: its hop's bytes go
        (the recorder holds each event once, as per-event delivery would);
        its columns, if ever asked for, are the event's leaves. Set before
        the bytes go: a reader on another thread may be looking."""
        self._treedef, self._static, self._count = treedef, static or {}, count
        self._steps = steps
        self._events = [event]
        self._raw = (None, self._raw[1])

    def _event_leaves(self) -> list:
        """The array leaves of a settled block's one event, as its columns
        hold them (kept bytes come from built-in containers alone)."""
        value = self._events[0].value
        if self._treedef is None:
            return [value]
        leaves = self._treedef.flatten_up_to(value)
        return [v for i, v in enumerate(leaves) if i not in self._static]

    def __getstate__(self):
        """Picklable (and copyable): a kept block pickles as its event,
        without its hop's bytes or their decoder (a closure)."""
        if self._raw is not None:
            decode_kept([self])
        if self._raw is not None:
            self._materialized()
        state = {name: getattr(self, name) for name in self.__slots__}
        if state["_raw"] is not None:
            state["_raw"] = (None, None)  # still marks one kept event (see FlightRecorder.df)
        return None, state

    def tail(self, n: int) -> "TapBlock":
        """The last ``n`` rows (a view)."""
        cut = len(self) - n
        return TapBlock(self.path, self.kind, self.total, self.lane, self.steps[cut:],
                        leaves=[c[cut:] for c in self._leaves], treedef=self._treedef, static=self._static,
                        count=self._count, origin=self.origin,
                        lanes=None if self._lanes is None else self._lanes[cut:])

    def nbytes(self) -> int:
        raw = self._raw
        if self._cols is None and raw is not None and raw[0] is not None:
            return len(raw[0])
        return int(self.steps.nbytes + sum(c.nbytes for c in self._leaves))


class RawRun:
    """Consecutive unbuffered events a recorder kept as their hops' bytes:
    one growing buffer, each row's end and site; no Python object per
    event (a million TapBlocks would cost the collector of every
    Python object, the user's own included, seconds). Read, it becomes the
    one-event :meth:`TapBlock.of_bytes` blocks it stands for.

    Examples
    --------
    >>> import numpy as np
    >>> run = RawRun()
    >>> run.add("scan[0]", "carry", 3, np.arange(4, dtype=np.uint8), None)
    >>> run.add("scan[0]", "carry", 3, np.arange(4, dtype=np.uint8), None)
    >>> [(b.path, len(b)) for b in run.blocks()]
    [('scan[0]', 1), ('scan[0]', 1)]
    """

    __slots__ = ("_sites", "_site_of", "_ids", "_ends", "_data")

    def __init__(self):
        self._sites: list = []  # (path, kind, total, decode) per site id
        self._site_of: dict = {}
        self._ids = array.array("I")
        self._ends = array.array("Q")
        self._data = bytearray()

    def add(self, path, kind, total, raw, decode) -> None:
        """One event: ``raw`` (a contiguous buffer, copied here) and how to decode it."""
        key = (path, kind, total, decode)
        sid = self._site_of.get(key)
        if sid is None:
            sid = self._site_of[key] = len(self._sites)
            self._sites.append(key)
        self._data += memoryview(raw)  # (never `+= array`: numpy would take it as its own add)
        self._ids.append(sid)
        self._ends.append(len(self._data))

    def __len__(self) -> int:
        return len(self._ids)

    def blocks(self) -> list:
        """The events as one-event blocks kept as bytes, in arrival order
        (views of the run's buffer: it goes when the last is decoded)."""
        data, sites, out, start = memoryview(self._data), self._sites, [], 0
        for sid, end in zip(self._ids, self._ends):
            path, kind, total, decode = sites[sid]
            out.append(TapBlock.of_bytes(path, kind, total, data[start:end], decode))
            start = end
        return out


def decode_kept(items) -> None:
    """Decode every block in ``items`` still kept as bytes (see
    :meth:`TapBlock.of_bytes`), a site at a time: one stack and one unpack
    per site instead of one per event, each one-event block keeping its
    event, each block of lanes its columns."""
    groups: dict = {}
    for item in items:
        if isinstance(item, TapBlock) and item._events is None:
            raw = item._raw  # read once: another reader may be letting the bytes go
            if raw is not None and raw[0] is not None:
                key = (raw[1], item.path, item.kind, item.total, item._lanes is not None)
                groups.setdefault(key, []).append((item, raw[0]))
    for (decode, path, kind, total, lanes), members in groups.items():
        if lanes:
            _decode_lanes(decode, members)
            continue
        rows = np.frombuffer(b"".join([raw for _, raw in members]), np.uint8).reshape(len(members), -1)
        steps, leaves, treedef, static, count = decode(rows)
        whole = TapBlock(path, kind, total, None, steps, leaves=leaves, treedef=treedef, static=static,
                         count=count)
        steps = whole.steps
        for i, ((block, _), event) in enumerate(zip(members, whole._build())):
            block._settle(event, steps[i:i + 1], treedef, static, count)


def _decode_lanes(decode, members) -> None:
    """Blocks of lanes kept as bytes, decoded in one unpack: each keeps its
    rows of the stacked columns (views), and builds events when asked."""
    n = sum(len(block) for block, _ in members)
    rows = np.frombuffer(b"".join([raw for _, raw in members]), np.uint8).reshape(n, -1)
    steps, leaves, treedef, static, count = decode(rows)
    steps, leaves = _frozen(steps), [_frozen(c) for c in leaves]
    at = 0
    for block, _ in members:
        end = at + len(block)
        block._treedef, block._static, block._count = treedef, static or {}, count
        block._cols = [c[at:end] for c in leaves]
        block._steps = steps[at:end]
        block._raw = None  # last: a reader on another thread checks it
        at = end


def _frozen(a: np.ndarray) -> np.ndarray:
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _rows(column: np.ndarray) -> list:
    """Per-event values of a column: numpy scalars for a 1-d one, small
    arrays otherwise (each its own copy, as per-event delivery gives)."""
    if column.ndim == 1:
        return list(column)
    return [r.copy() for r in column]


def column_block(path, kind, total, lane, steps, arrays, layout, count, origin=NO_ORIGIN) -> Optional[TapBlock]:
    """The block of one meta's ``count`` buffered rows (host copies)."""
    steps = np.array(steps[:count])
    cols = [np.array(a[:count]) for a in arrays]
    if layout.bare:
        return TapBlock(path, kind, total, lane, steps, cols[0], origin=origin)
    return TapBlock(path, kind, total, lane, steps, leaves=cols, treedef=layout.treedef, static=layout.static,
                    count=layout.count, origin=origin)


def frame_columns(block: TapBlock, flatten) -> Optional[dict]:
    """``FlightRecorder.df()`` columns of a block, built from its arrays;
    None when only its events can say (a custom pytree node in the value).

    ``flatten(value, name, row, top=True)`` names the value's columns as the
    per-event frame does; numbers widen as pandas widens Python numbers.
    """
    cols: dict = {}
    flatten(block.values, "value", cols, top=True)
    statics = list(block._static.values())
    out, n = {}, len(block)
    for name, col in cols.items():
        if isinstance(col, np.ndarray) and col.ndim >= 1 and len(col) == n and any(col is c for c in block._leaves):
            out[name] = _widened(col) if col.ndim == 1 else [np.array(r) for r in col]
        elif any(col is v for v in statics) or (not isinstance(col, np.ndarray) and _is_plain(col)):
            out[name] = [col] * n  # a static leaf: the same on every row
        else:
            return None
    return out


def _is_plain(x) -> bool:
    return x is None or isinstance(x, (bool, int, float, complex, str, bytes))


def _widened(col: np.ndarray) -> np.ndarray:
    """A column as pandas types the same numbers given one by one (Python
    floats, ints, complexes); other dtypes (bool, uint64) as they are."""
    kind, size = col.dtype.kind, col.dtype.itemsize
    if kind == "f" or (kind == "V" and size <= 8 and col.dtype.name.startswith(("bfloat", "float"))):
        return col.astype(np.float64)
    if kind == "c":
        return col.astype(np.complex128)
    if kind == "i" or (kind == "u" and size < 8):
        return col.astype(np.int64)
    return col
