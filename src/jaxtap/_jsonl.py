"""JSON-lines telemetry files: the writer, and a crash-safe streaming reader.

A file is one JSON object per event, written and flushed one whole line at a
time, so a crashed run leaves every event it streamed plus at most one cut
line at the end. The reader keeps every complete event, drops a cut final
line with one warning, and names the file and line of anything else it
cannot read. Values are checked against their declared shape before
anything is allocated. Files written by jax-tap 0.3.1 (``value_kind`` /
``value``) read back too.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import re
import threading
import warnings
from typing import Any, Dict, Iterator, List

import numpy as np

from . import _seam
from ._collectors import _flatten_value
from ._event import KINDS, TAG_FIELDS, TapEvent, make_event
from ._host import TapWarning, warn_once_now

try:  # optional (``jax-tap[fast]``): numbers' text in C, 20x faster than repr
    import orjson as _orjson
except Exception:  # noqa: BLE001 - absent or broken: repr writes the same text
    _orjson = None

_ERRORS = ("raise", "skip")


# ------------------------------------------------------------------ encoding
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


def _flat_columns(value) -> dict:
    row: dict = {}
    _flatten_value(value, "value", row, top=True)
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}


_TAGS = TAG_FIELDS


def _line(event) -> str:
    record = {"path": event.path, "step": event.step, "total": event.total, "kind": event.kind}
    for name, tag in zip(_TAGS, event[5:10]):  # lane, shard, device, process, backward: only when set
        if tag is not None:
            record[name] = tag
    record.update({k: v for k, v in _flat_columns(event.value).items() if k not in record})
    record["__value__"] = _encode(event.value)
    return json.dumps(record, default=repr, allow_nan=True) + "\n"


_STEP_MARK = -918273645  # sentinels of a line template (see _block_text)
_VALUE_MARKS = {"f": 0.123456789, "i": 12345678}


def _block_text(block):
    """Every line of a block of finite float / int scalars, from one template
    line (the very line :func:`_line` writes, with marked step and value);
    None when the block is not such a block."""
    col = block.values
    if not isinstance(col, np.ndarray) or col.ndim != 1 or col.dtype.kind not in "fi" or col.dtype.itemsize < 4:
        return None
    if col.dtype.kind == "f" and not np.isfinite(col).all():
        return None
    pieces = _template(block.path, block.kind, block.total, block.lane, block.origin, col.dtype.str)
    if pieces is None:
        return None
    texts = _number_texts(col)  # each value's text once: it appears twice per line
    # the lines' pieces laid out by slice assignment, then one join: no
    # Python frame and no tuple per line (half the cost of zipping them)
    parts = list(pieces) * len(texts)
    parts[1::7] = _number_texts(block.steps)
    parts[3::7] = texts
    parts[5::7] = texts
    return "".join(parts)


@functools.lru_cache(maxsize=256)
def _template(path, kind, total, lane, origin, dtype):
    """A block line's seven pieces (``None`` where a number goes), cut out of
    the line :func:`_line` writes for a marked step and value; None when the
    marks cannot be found unambiguously."""
    dtype = np.dtype(dtype)
    mark = dtype.type(_VALUE_MARKS[dtype.kind])
    template = _line(make_event(path, _STEP_MARK, mark, total, kind, lane, origin))
    value_text = repr(mark.item())
    head, sep, rest = template.partition(str(_STEP_MARK))
    parts = rest.split(value_text)
    if not sep or len(parts) != 3 or str(_STEP_MARK) in rest or value_text in head:
        return None
    mid, between, tail = parts
    return (head, None, mid, None, between, None, tail)


def _number_texts(col) -> list:
    """``repr`` of each number of a 1-d int or finite float column, as
    Python writes it (a float32 as the float64 it widens to). With orjson
    the digits come from C (the same shortest round-trip digits); only
    its positional form of magnitudes below 1e-4 differs from repr's
    exponent form, so those few are written by repr."""
    if _orjson is None:
        return list(map(repr, col.tolist()))
    wide = col.astype(np.float64 if col.dtype.kind == "f" else np.int64)
    texts = _orjson.dumps(wide, option=_orjson.OPT_SERIALIZE_NUMPY).decode("ascii")[1:-1].split(",")
    if col.dtype.kind == "f":
        for i in np.flatnonzero((np.abs(wide) < 1e-4) & (wide != 0)).tolist():
            texts[i] = repr(float(wide[i]))
    return texts


class JSONLWriter:
    """Streams events to a JSON-lines file, one object per event, flushed per line.

    Callable as an ``on_step``; a context manager; ``.close()`` when done.
    Each line holds ``path``, ``step``, ``total``, ``kind`` (``lane`` under
    ``jax.vmap``), ``value`` (exact,
    with dtypes and shapes, for :func:`read_jsonl`) and flat ``value``
    columns for ``pandas.read_json(path, lines=True)``. An unwritable path or
    a full disk warns once and stops the writer (the file keeps every line
    written before); the program is never disturbed.

    Under ``jax.distributed`` with several processes, each process writes
    its own file: ``run.jsonl`` becomes ``run.p0.jsonl``, ``run.p1.jsonl``,
    ... (decided at the first write, so a writer made before
    ``jax.distributed.initialize`` splits too; ``.path`` then names the
    process's file). :func:`read_jsonl` of ``run.jsonl`` merges them.

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

    def __init__(self, path, *, overwrite: bool = False):
        self.path = path
        self._lock = threading.Lock()
        self._failed = False
        self._fh = None
        self._placed = False  # one file per process: decided at the first write
        self._mode = "w" if overwrite else "a"
        try:
            self._created = overwrite or not os.path.exists(path)
            self._fh = open(path, self._mode, encoding="utf-8")
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _place(self) -> None:
        """In a multi-process run, move to this process's own file (called
        under the lock, at the first write)."""
        self._placed = True
        process = _seam.process_tag()
        if process is None:
            return
        base, fh = self.path, self._fh
        self.path = process_path(base, process)
        self._fh = open(self.path, self._mode, encoding="utf-8")
        fh.close()
        self._leave_shared_name(base)

    def _leave_shared_name(self, base) -> None:
        """Remove the shared ``run.jsonl`` this writer created, if empty: the
        name stays free for the merged reading of the per-process files."""
        try:  # a regular file only: never os.devnull or another device
            if self._created and os.path.isfile(base) and os.path.getsize(base) == 0:
                os.remove(base)
        except OSError:
            pass  # another process removed it first

    def _fail(self, exc) -> None:
        # stop at the first failure: a later write that succeeds after a cut
        # line would bury the cut in the middle of the file
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except Exception:  # noqa: BLE001
                pass
        if not self._failed:
            self._failed = True
            warn_once_now(f"jax-tap: JSONLWriter cannot write {self.path!r} ({exc}); "
                          "the file keeps the events written so far, later events are dropped.")

    def __call__(self, event: TapEvent) -> None:
        self._write([event])

    def on_block(self, block) -> None:
        """A buffered block of events (:class:`jaxtap.TapBlock`): every line
        in one write, flushed once (a crash keeps what was streamed)."""
        if self._fh is None:
            return
        try:
            text = _block_text(block)
        except Exception:  # noqa: BLE001 - the general path below decides
            text = None
        if text is None:
            self._write(block.events())
        else:
            self._write((), text)

    def _write(self, events, text=None) -> None:
        if self._fh is None:
            return
        try:
            if text is None:
                text = "".join(_line(e) for e in events)
            with self._lock:
                if not self._placed and self._fh is not None:
                    self._place()
                if self._fh is not None:
                    self._fh.write(text)
                    self._fh.flush()
        except Exception as exc:  # noqa: BLE001 - full disk, closed file, ...
            with self._lock:
                self._fail(exc)

    def close(self) -> None:
        with self._lock:
            idle = not self._placed and self._fh is not None and _seam.process_tag() is not None
            if self._fh is not None:
                try:
                    self._fh.close()
                except Exception:  # noqa: BLE001
                    pass
                self._fh = None
            if idle:
                self._leave_shared_name(self.path)  # this process wrote nothing

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


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


def _array(obj) -> Any:
    try:
        dtype = np.dtype(obj["dtype"])
    except KeyError:
        raise _Bad("an array value has no dtype") from None
    except TypeError:
        raise _Bad(f"unknown dtype {obj['dtype']!r}") from None
    shape = obj.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise _Bad(f"an array shape must be a list of non-negative ints, got {shape!r}")
    data = obj["__nd__"]
    if isinstance(data, dict) and "bits" in data:
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


def process_path(path, process: int) -> str:
    """The file process ``process`` writes for ``path``: ``run.jsonl`` ->
    ``run.p1.jsonl``."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.p{process}{ext}"


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
