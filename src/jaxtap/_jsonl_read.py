"""Reading JSON-lines telemetry files: the crash-safe streaming reader.

The reader keeps every complete event, drops a cut final line (what a crash
mid-write leaves) with one warning, and names the file and line of anything
else it cannot read. Values are checked against their declared shape before
anything is allocated. Files written by jax-tap 0.3.1 (``value_kind`` /
``value``) read back too. The writer is :mod:`._jsonl`.
"""
from __future__ import annotations

import glob
import json
import os
import re
import warnings
from typing import Any, Dict, Iterator, List

import numpy as np

from ._collectors import _flatten_value
from ._event import KINDS, TapEvent
from ._host import TapWarning, warn_once_now
from ._jsonl import _ERRORS, _TAGS


# ------------------------------------------------------------------ decoding
class _Bad(Exception):
    """What is wrong with one line (the reader adds file and line)."""


def _floats(data):
    if isinstance(data, list):
        return [_floats(v) for v in data]
    if isinstance(data, dict):
        try:
            return float(data["__float__"])
        except (KeyError, TypeError, ValueError):
            raise _Bad(f"a float entry {data!r} is not {{'__float__': 'nan' | 'inf' | '-inf'}}") from None
    return data


def _count(data, shape) -> None:
    """Check that nested lists ``data`` have exactly ``shape`` (no allocation)."""
    if not shape:
        if isinstance(data, list):
            raise _Bad("the value has more nesting than its shape says")
        return
    if not isinstance(data, list) or len(data) != shape[0]:
        got = len(data) if isinstance(data, list) else "a scalar"
        raise _Bad(f"the value does not match its shape {list(shape)}: {got} entries where {shape[0]} belong")
    for item in data:
        _count(item, shape[1:])


_FLOAT0 = np.dtype([("float0", np.void, 0)])  # jax.dtypes.float0 (a gradient of ints), written "float0"


def _array(obj) -> Any:
    try:
        dtype = _FLOAT0 if obj["dtype"] == "float0" else np.dtype(obj["dtype"])
    except KeyError:
        raise _Bad("an array value has no dtype") from None
    except TypeError:
        raise _Bad(f"unknown dtype {obj['dtype']!r}") from None
    shape = obj.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise _Bad(f"an array shape must be a list of non-negative ints, got {shape!r}")
    data = obj["__nd__"]
    if dtype == _FLOAT0:
        arr = np.zeros(shape, dtype)
    elif isinstance(data, dict) and "bits" in data:
        if dtype.itemsize not in (1, 2, 4, 8):
            raise _Bad(f"a bit-exact value needs a 1, 2, 4 or 8 byte dtype, not {dtype}")
        _count(data["bits"], shape)
        arr = np.asarray(data["bits"], dtype=f"uint{8 * dtype.itemsize}").view(dtype)
    elif dtype.kind == "c":
        if not isinstance(data, dict) or "re" not in data or "im" not in data:
            raise _Bad("a complex value needs 're' and 'im' parts")
        _count(data["re"], shape)
        _count(data["im"], shape)
        arr = np.empty(shape, dtype)
        arr.real = np.asarray(_floats(data["re"]))
        arr.imag = np.asarray(_floats(data["im"]))
    elif dtype.kind in "VO":
        return data  # written as a repr: kept as text
    else:
        _count(data, shape)
        try:
            arr = np.asarray(_floats(data), dtype=dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise _Bad(f"the value is not {dtype}: {exc}") from None
    arr = arr.reshape(shape)
    return arr[()] if obj.get("scalar") else arr


def _decode(obj) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, dict):
        if "__nd__" in obj:
            return _array(obj)
        if "__dict__" in obj:
            return {_hashable(_decode(k)): _decode(v) for k, v in _pairs(obj["__dict__"])}
        if "__tuple__" in obj:
            items = obj["__tuple__"]
            if not isinstance(items, list):
                raise _Bad("a tuple value must be a list")
            return tuple(_decode(v) for v in items)
        if "__float__" in obj:
            return _floats(obj)
        return {k: _decode(v) for k, v in obj.items()}
    return obj


def _pairs(items):
    if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
        raise _Bad("a dict value must be a list of [key, value] pairs")
    return items


def _hashable(key):
    try:
        hash(key)
    except TypeError:
        raise _Bad(f"a dict key {key!r} is not hashable") from None
    return key


# jax-tap 0.3.1 lines: {"path", "step", "value_kind", "value", "kind", ...}
def _value_031(kind, value) -> Any:
    kind = str(kind).lower()
    if value is None or kind in ("none", "null"):
        return None
    if kind in ("tuple", "list"):
        items = [_plain_031(v) for v in (value if isinstance(value, list) else [value])]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict" and isinstance(value, dict):
        return {k: _plain_031(v) for k, v in value.items()}
    if kind in ("str", "string", "repr", "text"):
        return str(value)
    return _plain_031(value)


def _plain_031(value) -> Any:
    """Numbers and nested number lists as numpy; anything else as it is."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return np.asarray(value)[()]
    if isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged
            return [_plain_031(v) for v in value]
        return arr if arr.dtype.kind in "biuf" else [_plain_031(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain_031(v) for k, v in value.items()}
    return value


def _event(rec) -> TapEvent:
    """One parsed line as a TapEvent, in either format."""
    if not isinstance(rec, dict):
        raise _Bad(f"expected a JSON object, got {type(rec).__name__}")
    if "__value__" in rec:
        value = _decode(rec["__value__"])
    elif "value_kind" in rec and "value" in rec:
        value = _value_031(rec["value_kind"], rec["value"])
    else:
        raise _Bad("unknown format: a jax-tap line holds 'path', 'step' and '__value__' (jax-tap 0.4) or "
                   f"'value_kind' and 'value' (jax-tap 0.3.1); this one has {sorted(rec)[:8]}")
    path, step, total, kind = rec.get("path"), rec.get("step"), rec.get("total"), rec.get("kind", "carry")
    if not isinstance(path, str):
        raise _Bad(f"'path' must be a string, got {path!r}")
    if not isinstance(step, int) or isinstance(step, bool):
        raise _Bad(f"'step' must be an int, got {step!r}")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool)):
        raise _Bad(f"'total' must be an int or null, got {total!r}")
    if kind not in KINDS:
        raise _Bad(f"'kind' must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    tags = [rec.get(name) for name in _TAGS]
    for name, tag in zip(_TAGS, tags):
        if name == "backward":
            if tag is not None and tag is not True:
                raise _Bad(f"'backward' must be true or null, got {tag!r}")
        elif tag is not None and (not isinstance(tag, int) or isinstance(tag, bool)):
            raise _Bad(f"'{name}' must be an int or null, got {tag!r}")
    return TapEvent(path, step, value, total, kind, *tags)


# ------------------------------------------------------------------ reading
def _check_errors(errors):
    if errors not in _ERRORS:
        raise ValueError(f"jax-tap: errors= must be 'raise' or 'skip', got {errors!r}")


def process_files(path) -> List[tuple]:
    """``(process, file)`` of the per-process files of ``path``, by process."""
    stem, ext = os.path.splitext(path)
    pattern = re.compile(re.escape(stem) + r"\.p(\d+)" + re.escape(ext) + "$")
    found = []
    for name in glob.glob(glob.escape(stem) + ".p*" + glob.escape(ext)):
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), name))
    return sorted(found)


def iter_jsonl(path, *, errors: str = "raise") -> Iterator[TapEvent]:
    """Stream the events of a JSONL telemetry file, one at a time.

    A multi-process run's files (``run.p0.jsonl``, ``run.p1.jsonl``, ...,
    see :class:`JSONLWriter`) are read as one when ``path`` names their
    shared ``run.jsonl``: process after process, each file in its order
    (:func:`read_jsonl` merges them by process, path and step).

    Memory stays constant however long the file. A final line cut
    mid-write (a crashed or killed run) is dropped with one warning naming
    the file and line; every complete event before it is returned. Any other
    unreadable line raises ``ValueError`` naming the file, the line and what
    is wrong, or, with ``errors="skip"``, is skipped (one warning at the end
    with the count and the first bad line). Reads files written by
    :class:`JSONLWriter` and by jax-tap 0.3.1.

    Examples
    --------
    >>> import os, tempfile, jaxtap as tap
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> with tap.JSONLWriter(path) as out:
    ...     out(tap.TapEvent("scan[0]", 0, 1.5, 2))
    >>> [(e.path, e.step, e.value) for e in tap.iter_jsonl(path)]
    [('scan[0]', 0, 1.5)]
    """
    _check_errors(errors)
    parts = process_files(path)
    if not parts:
        yield from _iter_file(path, errors)
        return
    if os.path.exists(path) and os.path.getsize(path):
        yield from _iter_file(path, errors)  # lines written before the run split
    for _, name in parts:
        yield from _iter_file(name, errors)


def _iter_file(path, errors):
    bad, first_bad = 0, None
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            event, why = _parse(raw)
            if why is None:
                yield event
            elif not raw.endswith(b"\n"):  # only the last line can lack its newline: cut mid-write
                _warn(f"jax-tap: {path}: the last line ({lineno}) was cut mid-write (a crashed run?) "
                      f"and is dropped; the {lineno - 1} lines before it are kept.")
            elif errors == "raise":
                raise ValueError(f"jax-tap: {path}, line {lineno}: {why}")
            else:
                bad, first_bad = bad + 1, first_bad or (lineno, why)
    if bad:
        _warn(f"jax-tap: {path}: skipped {bad} unreadable line{'s' if bad > 1 else ''}; "
              f"the first is line {first_bad[0]}: {first_bad[1]}")


def _parse(raw: bytes):
    """(event, None), or (None, what is wrong)."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg}, column {exc.colno})"
    except RecursionError:
        return None, "nested too deeply"
    try:
        return _event(rec), None
    except _Bad as exc:
        return None, str(exc)
    except RecursionError:
        return None, "nested too deeply"
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        return None, f"unreadable value ({type(exc).__name__}: {exc})"


def _warn(message):
    try:
        warnings.warn(message, TapWarning, stacklevel=3)
    except Exception:  # noqa: BLE001 - -W error: say it on stderr, keep the events
        warn_once_now(message)


def read_jsonl(path, *, errors: str = "raise") -> List[TapEvent]:
    """Read a JSONL telemetry file into a list of TapEvents.

    The same rules as :func:`iter_jsonl` (which streams instead): a cut
    final line is dropped with a warning; other bad lines raise
    ``ValueError`` naming file and line, or are skipped with
    ``errors="skip"``. A multi-process run's files (``run.p0.jsonl``, ...)
    are merged, in (process, path, step, shard) order, each run of a loop
    (a repeated call, an inner loop's run per outer step) kept together.
    """
    events = list(iter_jsonl(path, errors=errors))
    if process_files(path):
        events = _merged(events)
    return events


def _merged(events):
    """A multi-process run's events in (process, path, call, step, shard)
    order: ``call`` counts the runs of a loop at one address (its steps
    starting over), so repeated calls and inner loops keep their runs."""
    runs, last, keys = {}, {}, []
    for i, e in enumerate(events):
        where = (e.process, e.path, e.kind, e.shard, e.lane)
        if where in last and e.step <= last[where]:
            runs[where] = runs.get(where, 0) + 1
        last[where] = e.step
        keys.append((-1 if e.process is None else e.process, e.path, runs.get(where, 0), e.step,
                     -1 if e.shard is None else e.shard, i))
    return [events[k[-1]] for k in sorted(keys)]


def read_jsonl_columns(path, *, errors: str = "raise") -> Dict[str, np.ndarray]:
    """Stream a JSONL file straight into column arrays (no event objects kept).

    Columns ``path``, ``step``, ``total``, ``kind`` and the flattened value
    columns of :meth:`FlightRecorder.df` (``value``, ``value_0``, ...; a
    row without a column holds ``None``). ``pandas.DataFrame(columns)`` is
    the table.
    """
    cols: Dict[str, list] = {"path": [], "step": [], "total": [], "kind": []}
    n = 0
    for e in iter_jsonl(path, errors=errors):
        row: dict = {}
        _flatten_value(e.value, "value", row, top=True)
        tags = [(name, tag) for name, tag in zip(_TAGS[1:], e[6:10]) if tag is not None]
        for key, v in (("path", e.path), ("step", e.step), ("total", e.total), ("kind", e.kind), *tags,
                       *row.items()):
            col = cols.get(key)
            if col is None:
                col = cols[key] = [None] * n
            col.append(v)
        n += 1
        for col in cols.values():
            if len(col) < n:
                col.append(None)
    return {k: _column(v) for k, v in cols.items()}


def _column(values):
    if values and all(isinstance(v, (int, float, np.number, bool, np.bool_)) for v in values):
        return np.asarray(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
