"""Collectors: the in-memory FlightRecorder (with ``.df()``) and JSONL files."""
from __future__ import annotations

import collections
import json
import threading
from typing import Any, Iterator, List, Optional

import numpy as np

from ._event import TapEvent
from ._host import warn_once_now


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

    def append(self, event: TapEvent) -> None:
        """Record one event."""
        self._events.append(event)

    def _appender(self):
        """The cheapest callable that records one event (the host's hot path)."""
        return self._events.append if type(self).append is FlightRecorder.append else self.append

    def __call__(self, event: TapEvent) -> None:
        self._events.append(event)

    def clear(self) -> None:
        """Forget every recorded event."""
        self._events.clear()

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


# ------------------------------------------------------------------ JSONL
def _encode(value) -> Any:
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        arr = np.asarray(value)
        if arr.dtype.kind == "c":
            data = {"re": _encode_floats(arr.real), "im": _encode_floats(arr.imag)}
        elif arr.dtype.kind == "V" and arr.dtype.itemsize in (1, 2, 4, 8):
            # ml_dtypes (bfloat16, float8_*): keep the exact bits
            data = {"bits": arr.view(f"uint{8 * arr.dtype.itemsize}").tolist()}
        elif arr.dtype.kind in "VO":
            data = repr(arr)
        elif arr.dtype.kind == "f":
            data = _encode_floats(arr)
        else:
            data = arr.tolist()
        return {"__nd__": data, "dtype": str(arr.dtype), "shape": list(arr.shape), "scalar": isinstance(value, np.generic)}
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return {"__float__": repr(value)}
    return value


def _encode_floats(arr):
    """Floats as JSON numbers, with NaN/Inf spelled out (JSON has no literal)."""
    flat = [v if np.isfinite(v) else {"__float__": repr(float(v))} for v in arr.ravel().tolist()]
    return np.array(flat, dtype=object).reshape(arr.shape).tolist() if arr.ndim else flat[0]


def _floats(data):
    if isinstance(data, list):
        return [_floats(v) for v in data]
    if isinstance(data, dict):
        return float(data["__float__"])
    return data


def _decode(obj) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, dict):
        if "__nd__" in obj:
            data, dtype = obj["__nd__"], np.dtype(obj["dtype"])
            if dtype.kind == "c":
                arr = np.empty(obj["shape"], dtype)
                arr.real = np.asarray(_floats(data["re"]))
                arr.imag = np.asarray(_floats(data["im"]))
            elif isinstance(data, dict) and "bits" in data:
                arr = np.asarray(data["bits"], dtype=f"uint{8 * dtype.itemsize}").view(dtype)
            else:
                arr = np.asarray(_floats(data), dtype=dtype)
            arr = arr.reshape(obj["shape"])
            return arr[()] if obj.get("scalar") else arr
        if "__dict__" in obj:
            return {_decode(k): _decode(v) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_decode(v) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        return {k: _decode(v) for k, v in obj.items()}
    return obj


def _flat_columns(value) -> dict:
    row: dict = {}
    _flatten_value(value, "value", row, top=True)
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}


class JSONLWriter:
    """Streams events to a JSON-lines file, one object per event, flushed per line.

    Callable as an ``on_step``; a context manager; ``.close()`` when done.
    Each line holds ``path``, ``step``, ``total``, ``kind``, ``value`` (exact,
    with dtypes and shapes, for :func:`read_jsonl`) and flat ``value``
    columns for ``pandas.read_json(path, lines=True)``. An unwritable path or
    a full disk warns once and never disturbs the program.

    Examples
    --------
    >>> import os, tempfile, jax, jax.numpy as jnp, jaxtap as tap
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> with tap.JSONLWriter(path) as out:
    ...     g = tap.verbose(lambda x: jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=2),
    ...                     on_step=out, select=lambda leaves: leaves[0])
    ...     _ = jax.block_until_ready(g(jnp.float32(1.0)))
    >>> [float(e.value) for e in tap.read_jsonl(path)]
    [2.0, 4.0]
    """

    def __init__(self, path):
        self.path = path
        self._lock = threading.Lock()
        self._failed = False
        self._fh = None
        try:
            self._fh = open(path, "a", encoding="utf-8")
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fail(self, exc) -> None:
        if not self._failed:
            self._failed = True
            warn_once_now(f"jax-tap: JSONLWriter cannot write {self.path!r} ({exc}); events are dropped.")

    def __call__(self, event: TapEvent) -> None:
        if self._fh is None:
            return
        try:
            record = {"path": event.path, "step": event.step, "total": event.total, "kind": event.kind}
            record.update({k: v for k, v in _flat_columns(event.value).items() if k not in record})
            record["__value__"] = _encode(event.value)
            line = json.dumps(record, default=repr, allow_nan=True)
            with self._lock:
                self._fh.write(line + "\n")
                self._fh.flush()
        except Exception as exc:  # noqa: BLE001 - full disk, closed file, ...
            self._fail(exc)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                try:
                    self._fh.close()
                except Exception:  # noqa: BLE001
                    pass
                self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def read_jsonl(path) -> List[TapEvent]:
    """Read a file written by :class:`JSONLWriter` back into TapEvents."""
    events = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            events.append(
                TapEvent(rec["path"], int(rec["step"]), _decode(rec["__value__"]), rec.get("total"), rec.get("kind", "carry"))
            )
    return events
