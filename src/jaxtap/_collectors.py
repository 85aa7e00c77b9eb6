"""Collectors: the in-memory FlightRecorder (with ``.df()``); JSONL files are in ``_jsonl``."""
from __future__ import annotations

import collections
import time
from typing import Iterator, List, Optional

import numpy as np

from ._event import TapEvent


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

    def __init__(self, maxlen: Optional[int] = None):
        if maxlen is not None and (not isinstance(maxlen, int) or isinstance(maxlen, bool) or maxlen < 1):
            raise ValueError(f"jax-tap: FlightRecorder(maxlen=...) must be a positive int or None, got {maxlen!r}")
        self._events = _store((), maxlen)
        self._times = None  # arrival times (time.time()), parallel to _events, once keep_times()
        self._spans = None  # the scope's jit-event taps (their compile spans), for timeline()
        # Appends, copies and clears of a list/deque are single C calls under
        # the GIL, so they need no lock.

    @property
    def events(self) -> List[TapEvent]:
        """The recorded events, oldest first (a list snapshot). Assignable,
        as in jax-tap 0.3.1 (``rec.events = []`` clears the recorder)."""
        return list(self._events)

    @events.setter
    def events(self, events) -> None:
        self._events = _store(events, getattr(self._events, "maxlen", None))
        if self._times is not None:
            self._times = _store([None] * len(self._events), getattr(self._events, "maxlen", None))

    def keep_times(self) -> None:
        """Also keep each event's arrival time (for :meth:`timeline`)."""
        if self._times is None:
            self._times = _store([None] * len(self._events), getattr(self._events, "maxlen", None))

    def append(self, event: TapEvent) -> None:
        """Record one event."""
        if self._times is not None:
            self._times.append(time.time())
        self._events.append(event)

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
        self._events.clear()
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
        from ._timeline import write_timeline
        spans = list(self._spans.spans) if self._spans is not None else []
        times = list(self._times) if self._times is not None else [None] * len(self._events)
        write_timeline(path, list(self._events), times, spans)

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[TapEvent]:
        return iter(self.events)

    def __repr__(self) -> str:
        return f"FlightRecorder({len(self)} events)"

    def df(self, *, kind: bool = False, total: bool = False):
        """A tidy pandas DataFrame, one row per event.

        Columns: ``path``, ``step``, then the value: a scalar becomes
        ``value`` (so does a one-element tuple); a tuple or list ``value_0``,
        ``value_1``, ...; a dict one
        column per key (nested containers are flattened with ``_``).
        ``kind=True`` / ``total=True`` add those columns.

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
        rows = []
        for e in self.events:
            row = {"path": e.path, "step": e.step}
            if kind:
                row["kind"] = e.kind
            if total:
                row["total"] = e.total
            _flatten_value(e.value, "value", row, top=True)
            rows.append(row)
        base = ["path", "step"] + (["kind"] if kind else []) + (["total"] if total else [])
        return pd.DataFrame(rows, columns=None if rows else base)


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
