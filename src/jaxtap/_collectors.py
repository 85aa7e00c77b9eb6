"""Collectors: the in-memory FlightRecorder (with ``.df()``); JSONL files are in ``_jsonl`` (writer) and ``_jsonl_read``."""
from __future__ import annotations

import collections
import threading
import time
import types
from typing import Iterator, List, Optional

import numpy as np

from ._blocks import RawRun, TapBlock, decode_kept, frame_columns
from ._event import TAG_FIELDS, TapEvent


class _EventList(list):
    """A recorder's events as a list whose in-place edits act on the
    recorder, as on 0.3.1's plain list attribute: an edit first takes in
    what the recorder holds now (events recorded since the list was read
    included, evicted ones gone), then writes the result back. Reading it
    is a snapshot. Edit after a block, not while it records into the same
    recorder: an event arriving during an edit can be lost, and an edit
    drops the arrival times ``timeline()`` places runtime events by."""

    def __init__(self, recorder, events):
        super().__init__(events)
        self._recorder = recorder

    def clear(self):
        self._recorder.clear()
        list.clear(self)

    def __reduce__(self):  # pickles and copies as the plain list it shows
        return list, (list(self),)


def _write_through(name):
    method = getattr(list, name)

    def edit(self, *args, **kwargs):
        list.__setitem__(self, slice(None), self._recorder._listed())
        out = method(self, *args, **kwargs)
        self._recorder.events = list(self)
        return self if name.startswith("__i") else out

    edit.__name__ = name
    return edit


for _name in ("append", "extend", "insert", "pop", "remove", "sort", "reverse",
              "__setitem__", "__delitem__", "__iadd__", "__imul__"):
    setattr(_EventList, _name, _write_through(_name))


class FlightRecorder:
    """Keeps TapEvents in arrival order; callable as an ``on_step``.

    Parameters
    ----------
    maxlen : int, optional
        Keep only the last ``maxlen`` events (bounded memory for long runs).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> rec = tap.FlightRecorder()
    >>> g = tap.verbose(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3),
    ...                 on_step=rec, select=lambda leaves: leaves[0])
    >>> _ = jax.block_until_ready(g(jnp.float32(0.0)))
    >>> [float(e.value) for e in rec.events]
    [1.0, 2.0, 3.0]
    """

    _runs = 0  # (a recorder pickled before RawRuns has none)

    def __init__(self, maxlen: Optional[int] = None):
        if maxlen is not None and (not isinstance(maxlen, int) or isinstance(maxlen, bool) or maxlen < 1):
            raise ValueError(f"jax-tap: FlightRecorder(maxlen=...) must be a positive int or None, got {maxlen!r}")
        self._events = _store((), maxlen)  # TapEvents and (unbounded recorders) TapBlocks
        self._blocks = 0  # TapBlocks and RawRuns in _events ...
        self._runs = 0  # ... RawRuns among them
        self._extra = 0  # ... and the events they hold beyond one each
        self._times = None  # arrival times (time.time()), parallel to _events, once keep_times()
        self._spans = None  # the scope's jit-event taps (their compile spans), for timeline()
        # Appends, copies and clears of a list/deque are single C calls under
        # the GIL, so they need no lock.

    @property
    def events(self) -> List[TapEvent]:
        """The recorded events, oldest first (a list). Assignable, and its
        in-place edits (``rec.events.clear()``, ``del rec.events[:10]``)
        write through to the recorder, as in jax-tap 0.3.1. Buffered blocks
        are kept as columns and become TapEvents here."""
        return _EventList(self, self._listed())

    def _listed(self) -> list:
        items, blocks = self._items()
        if not blocks:
            return items
        decode_kept(items)
        out: list = []
        for item in items:
            if isinstance(item, TapBlock):
                out.extend(item._materialized())
            else:
                out.append(item)
        return out

    @events.setter
    def events(self, events) -> None:
        events = list(events)
        with _BLOCK_LOCK:  # in place: a running block's appender keeps recording here
            self._events.clear()
            self._events.extend(events)
            self._blocks = self._extra = self._runs = 0
            if self._times is not None:
                self._times.clear()
                self._times.extend([None] * len(self._events))

    def __getstate__(self):
        """Picklable: blocks kept as their hops' bytes are decoded first (a
        site at a time) and pickle as their events."""
        items, stamps = self._snapshot(times=True)  # (runs opened: what it holds now, consistently)
        maxlen = getattr(self._events, "maxlen", None)
        state = self.__dict__.copy()
        state["_events"] = _store(items, maxlen)
        state["_times"] = None if self._times is None else _store(stamps, maxlen)
        state["_blocks"] = sum(isinstance(item, TapBlock) for item in items)
        state["_extra"] = sum(len(item) - 1 for item in items if isinstance(item, TapBlock))
        state["_runs"] = 0
        # the jit-event taps hold the live block's sink: only their spans pickle
        state["_spans"] = None if self._spans is None else types.SimpleNamespace(spans=list(self._spans.spans))
        return state

    def _snapshot(self, times: bool = False):
        """The stored items, listed under the lock, hops kept as bytes
        decoded (a site at a time); with ``times``, also their arrival times."""
        with _BLOCK_LOCK:
            self._open_runs()
            items = list(self._events)
            stamps = None
            if times:
                stamps = list(self._times) if self._times is not None else [None] * len(items)
        decode_kept(items)
        return (items, stamps) if times else items

    def _items(self):
        """(a list snapshot of the stored items, whether any is a block)."""
        with _BLOCK_LOCK:
            self._open_runs()
            return list(self._events), self._blocks

    def _open_runs(self) -> None:
        """Replace each RawRun in the store by its one-event blocks (under
        the lock; items other threads append meanwhile go after them)."""
        events = self._events
        if not self._runs:
            return
        items = list(events)
        last = max(i for i, item in enumerate(items) if type(item) is RawRun)
        opened: list = []
        for item in items[:last + 1]:
            if type(item) is RawRun:
                n = len(item)
                opened.extend(item.blocks())
                self._blocks += n - 1
                self._extra -= n - 1
            else:
                opened.append(item)
        events[:last + 1] = opened
        self._runs = 0

    def _keep_bytes(self, path, kind, total, raw, decode) -> None:
        """One unbuffered hop's event, kept as its bytes ``raw`` (a
        contiguous buffer, copied) until read: appended to the run of such
        events at the end of the store, no object per event."""
        with _BLOCK_LOCK:
            events = self._events
            run = events[-1] if events else None
            if self._times is not None:  # (each item keeps its arrival time: one block per event)
                self._append_block(TapBlock.of_bytes(path, kind, total, bytes(raw), decode), time.time())
                return
            if type(run) is not RawRun:
                run = RawRun()
                events.append(run)
                self._blocks += 1
                self._runs += 1
            else:
                self._extra += 1
            run.add(path, kind, total, raw, decode)

    def keep_times(self) -> None:
        """Also keep each event's arrival time (for :meth:`timeline`)."""
        with _BLOCK_LOCK:
            if self._times is None:
                self._open_runs()  # (a time per stored item: a run's events become items first)
                self._times = _store([None] * len(self._events), getattr(self._events, "maxlen", None))

    def append(self, event: TapEvent) -> None:
        """Record one event."""
        if self._times is not None:
            self._times.append(time.time())
        self._events.append(event)

    def append_block(self, block: TapBlock) -> None:
        """Record a block of events, kept as columns (a bounded recorder
        keeps the last ``maxlen`` of them as TapEvents)."""
        maxlen = getattr(self._events, "maxlen", None)
        now = time.time() if self._times is not None else None
        if maxlen:
            rows = block.tail(min(len(block), maxlen)).events()
            self._events.extend(rows)
            if self._times is not None:
                self._times.extend([now] * len(rows))
            return
        with _BLOCK_LOCK:  # callbacks of several devices may deliver at once
            self._append_block(block, now)

    def _append_block(self, block, now) -> None:
        self._events.append(block)
        self._blocks += 1
        self._extra += len(block) - 1
        if self._times is not None:
            self._times.append(now)

    def on_block(self, block: TapBlock) -> None:
        """As an ``on_step``, a recorder takes buffered blocks whole too."""
        append = self._block_appender()
        if append is not None:
            append(block)
            return
        for event in block.events():
            self.append(event)

    def _block_appender(self):
        """``append_block``, or None for a subclass that records events itself."""
        return self.append_block if type(self).append is FlightRecorder.append else None

    def _keeps_bytes(self) -> bool:
        """Whether ``append_block`` may take one-event blocks kept as their
        hop's bytes (:meth:`TapBlock.of_bytes`): not a bounded recorder
        (it keeps objects), nor a subclass that records events or blocks
        itself (kept bytes bypass both)."""
        return (getattr(self._events, "maxlen", None) is None and self._block_appender() is not None
                and type(self).append_block is FlightRecorder.append_block)

    def _appender(self):
        """The cheapest callable that records one event (the host's hot path)."""
        if type(self).append is not FlightRecorder.append:
            return self.append
        if self._times is None:
            return self._events.append
        events, times, clock = self._events, self._times, time.time

        def append(event):
            times.append(clock())
            events.append(event)

        return append

    def __call__(self, event: TapEvent) -> None:
        self.append(event)

    def clear(self) -> None:
        """Forget every recorded event."""
        with _BLOCK_LOCK:
            self._events.clear()
            self._blocks = self._extra = self._runs = 0
            if self._times is not None:
                self._times.clear()

    def timeline(self, path) -> None:
        """Write the recorded run as a Chrome trace-event JSON file (opens in
        Perfetto UI and ``chrome://tracing``): tracing / lowering / compiling
        spans per jitted function (with ``jit_events=True``), each loop's
        progress as a counter track, events as instants, alerts as markers.

        Runtime events are placed by their arrival time, which the recorder
        keeps when the block has ``timeline=True`` (or ``jit_events`` /
        ``trace_events``); without it they are left out.
        """
        from ._options import check_path
        from ._timeline import write_timeline
        check_path("timeline", path, "rec.timeline('run.trace.json')")
        spans = list(self._spans.spans) if self._spans is not None else []
        items, times = self._snapshot(times=True)
        events, stamps = [], []
        for item, t in zip(items, times):
            rows = item.events() if isinstance(item, TapBlock) else [item]
            events.extend(rows)
            stamps.extend([t] * len(rows))
        write_timeline(path, events, stamps, spans)

    def __len__(self) -> int:
        with _BLOCK_LOCK:
            return len(self._events) + self._extra

    def __iter__(self) -> Iterator[TapEvent]:
        return iter(self._listed())

    def __repr__(self) -> str:
        return f"FlightRecorder({len(self)} events)"

    def df(self, *, kind: bool = False, total: bool = False):
        """A tidy pandas DataFrame, one row per event.

        Columns: ``path``, ``step``, then the value: a scalar becomes
        ``value`` (so does a one-element tuple); a tuple or list ``value_0``,
        ``value_1``, ...; a dict one
        column per key (nested containers are flattened with ``_``).
        ``kind=True`` / ``total=True`` add those columns. Events from many
        devices or processes add ``shard``, ``device`` and ``process``
        columns (after ``step``; empty on rows without them).

        Raises
        ------
        ImportError
            When pandas is not installed (``pip install "jax-tap[pandas]"``).
        """
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                'FlightRecorder.df() needs pandas: pip install "jax-tap[pandas]"'
            ) from None
        base = ["path", "step"] + (["kind"] if kind else []) + (["total"] if total else [])
        frames, rows, run = [], [], []  # run: consecutive blocks' columns with the same names
        for item in self._snapshot():
            if isinstance(item, TapBlock) and item._raw is not None:  # one unbuffered hop's event
                item = item._materialized()[0]
            if not isinstance(item, TapBlock):
                if run:
                    frames.append(_frame_of(pd, run))
                    run = []
                rows.append(_row(item, kind, total))
                continue
            cols = _block_columns(item, kind, total)  # columns as they came
            if cols is None:
                if run:
                    frames.append(_frame_of(pd, run))
                    run = []
                rows.extend(_row(e, kind, total) for e in item.events())
                continue
            if rows:
                frames.append(pd.DataFrame(rows))
                rows = []
            if run and _signature(run[-1]) != _signature(cols):
                frames.append(_frame_of(pd, run))
                run = []
            run.append(cols)
        if run:
            frames.append(_frame_of(pd, run))
        if rows or not frames:
            frames.append(pd.DataFrame(rows, columns=None if rows else base))
        if len(frames) == 1:
            return _int_tags(frames[0])
        kinds: dict = {}
        for fr in frames:
            for name, dt in fr.dtypes.items():
                kinds.setdefault(name, set()).add(getattr(dt, "kind", "O"))
        mixed = [name for name, k in kinds.items() if "b" in k and len(k) > 1]
        if mixed:  # bools beside numbers: objects, as one frame of rows keeps them
            frames = [fr.astype({m: object for m in mixed if m in fr.columns}) for fr in frames]
        df = _int_tags(pd.concat(frames, ignore_index=True))
        if total:  # as one frame of rows infers it: None among ints is NaN
            totals = df["total"].tolist()
            if any(t is None for t in totals) and not all(t is None for t in totals):
                df["total"] = pd.to_numeric(df["total"]).astype("float64")
        return df


_BLOCK_LOCK = threading.Lock()


_ORIGIN_COLUMNS = TAG_FIELDS[1:]  # shard, device, process, backward


def _int_tags(df):
    """Tags on some rows only: integers with gaps (pandas' Int64), not floats."""
    for name in _ORIGIN_COLUMNS:
        if name in df.columns and df[name].isna().any():
            df[name] = df[name].astype("boolean" if name == "backward" else "Int64")
    return df


def _row(e, kind, total):
    row = {"path": e.path, "step": e.step}
    for name, tag in zip(_ORIGIN_COLUMNS, e[6:10]):
        if tag is not None:
            row[name] = tag
    if kind:
        row["kind"] = e.kind
    if total:
        row["total"] = e.total
    _flatten_value(e.value, "value", row, top=True)
    return row


def _signature(cols):
    """Column names and array dtypes: blocks merge only when both agree
    (a bool column next to an int one stays apart, as rows keep it)."""
    return [(k, v.dtype.str if isinstance(v, np.ndarray) else None) for k, v in cols.items()]


def _frame_of(pd, run):
    """One DataFrame of consecutive blocks' columns (same names)."""
    if len(run) == 1:
        return pd.DataFrame(run[0])
    out = {}
    for name in run[0]:
        parts = [cols[name] for cols in run]
        out[name] = (np.concatenate(parts) if all(isinstance(p, np.ndarray) for p in parts)
                     else [x for p in parts for x in p])
    return pd.DataFrame(out)


def _block_columns(block, kind, total):
    """A block's frame columns, or None: its rows, one by one, decide."""
    values = frame_columns(block, _flatten_value)
    if values is None:
        return None
    n = len(block)
    cols = {"path": [block.path] * n, "step": block.steps.astype(np.int64)}
    for name, tag in zip(_ORIGIN_COLUMNS, block.origin):
        if tag is not None:
            cols[name] = np.full(n, tag, bool if name == "backward" else np.int64)
    if kind:
        cols["kind"] = [block.kind] * n
    if total:
        cols["total"] = [block.total] * n
    cols.update(values)  # a value key named like a column wins, as in a row
    return cols


def _store(events, maxlen):
    """A recorder's event store: bounded (a deque) when ``maxlen`` is set."""
    return collections.deque(events, maxlen=maxlen) if maxlen else list(events)


def _flatten_value(value, name, row, top=False):
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten_value(v, str(k) if top else f"{name}_{k}", row)
    elif isinstance(value, (tuple, list)) and top and len(value) == 1:
        _flatten_value(value[0], name, row)  # a one-element tuple is `value` (as in jax-tap 0.3.1)
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _flatten_value(v, f"{name}_{i}", row)
    elif isinstance(value, np.ndarray) and value.ndim > 0:
        row[name] = value
    else:
        row[name] = value.item() if isinstance(value, np.generic) else value
