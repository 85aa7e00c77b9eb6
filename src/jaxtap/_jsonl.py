"""JSON-lines telemetry files: the writer.

A file is one JSON object per event, written and flushed one whole line at a
time (a buffered block's lines in one write), so a crashed run leaves every
event it streamed plus at most one cut line at the end. The reader is
:mod:`._jsonl_read`.
"""
from __future__ import annotations

import collections
import functools
import json
import math
import os
import re
import threading
from typing import Any

import jax
import numpy as np

from . import _seam
from ._collectors import _flatten_value
from ._event import TAG_FIELDS, TapEvent, make_event
from ._host import warn_once_now
from ._options import check_path

try:  # optional (``jax-tap[fast]``): numbers' text in C, 20x faster than repr
    import orjson as _orjson
except Exception:  # noqa: BLE001 - absent or broken: repr writes the same text
    _orjson = None

_ERRORS = ("raise", "skip")


# ------------------------------------------------------------------ encoding
def _encode(value) -> Any:
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        arr = np.asarray(value)
        if arr.dtype == jax.dtypes.float0:  # (a gradient of ints: no data)
            return {"__nd__": None, "dtype": "float0", "shape": list(arr.shape), "scalar": isinstance(value, np.generic)}
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
_VALUE_MARKS = {"f": (0.123456789, 0.000917253), "i": (97531864, 1)}  # (first, spacing)
_MAX_WIDTH = 4096  # numbers per row a template covers (wider rows: one line at a time)


def _block_text(block):
    """Every line of a block whose events' values are int, bool or finite
    float arrays of fixed shapes (one, or a pytree of them), from one
    template line (the very line :func:`_line` writes, with marked step
    and numbers); None when the block is not such a block."""
    leaves, n = block._leaves, len(block)
    if block.lanes is not None or block._static or not all(_fits(c, n) for c in leaves):
        return None
    if not n:
        return ""
    if any(c.dtype.kind == "f" and not np.isfinite(c).all() for c in leaves):
        return None
    tags = (block.total, block.lane, *block.origin)
    made = _template(block.path, block.kind, tags, tuple(map(type, tags)), block._treedef,
                     tuple((c.dtype, c.shape[1:]) for c in leaves))
    if made is None:
        return None
    return _fill(*made, _number_texts(block.steps), [_texts(c) for c in leaves], n)


def _event_text(event) -> str:
    """One event's line: from its template where its value is int, bool or
    finite float arrays (no JSON built in Python), else :func:`_line`."""
    try:
        return _templated(event)
    except Exception:  # noqa: BLE001 - e.g. dict keys that cannot be sorted: the general path
        return _line(event)


def _templated(event) -> str:
    if type(event.step) is not int:
        return _line(event)
    value = event.value
    if isinstance(value, (np.ndarray, np.generic)):
        leaves, treedef = (value,), None
    else:
        leaves, treedef = jax.tree_util.tree_flatten(value)
    sig, texts = [], []
    for v in leaves:
        # (a 0-d ndarray writes "scalar": false, unlike a column's row)
        if not (isinstance(v, np.generic) or isinstance(v, np.ndarray) and v.ndim) or not _wide(v.dtype):
            return _line(event)
        flat = v.ravel().tolist() if v.ndim else [v.item()]
        if v.dtype.kind == "b":
            texts.append(["true" if x else "false" for x in flat])
        elif v.dtype.kind == "f" and not all(map(math.isfinite, flat)):
            return _line(event)
        else:  # json writes a number as repr does
            texts.append(list(map(repr, flat)))
        sig.append((v.dtype, v.shape))
    if treedef is not None and _has_dict(treedef) and not _in_key_order(value):
        return _line(event)  # (a template lays a dict out in sorted key order, as a hop rebuilds it)
    # (types in the key: 1, 1.0 and True are equal keys, not equal texts)
    tags = (event.total, event.lane, *event[6:10])
    made = _template(event.path, event.kind, tags, tuple(map(type, tags)), treedef, tuple(sig))
    return _line(event) if made is None else _fill(*made, [str(event.step)], texts, 1)


@functools.lru_cache(maxsize=256)
def _has_dict(treedef) -> bool:
    data = treedef.node_data()
    return (data is not None and data[0] is dict) or any(_has_dict(c) for c in treedef.children())


def _in_key_order(value) -> bool:
    """Are the dicts in ``value`` in sorted key order (as a hop rebuilds them)?"""
    if isinstance(value, dict):
        keys = list(value)
        return keys == sorted(keys) and all(_in_key_order(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return all(_in_key_order(v) for v in value)
    return True


def _wide(dtype) -> bool:
    kind, size = dtype.kind, dtype.itemsize
    # (a uint64 would not widen to the int64 _number_texts reads it as)
    return kind == "b" or (kind in "fi" and size >= 4) or (kind == "u" and size == 4)


def _fits(col, n) -> bool:
    return isinstance(col, np.ndarray) and col.ndim >= 1 and len(col) == n and _wide(col.dtype)


def _texts(col) -> list:
    """Each number of a column (row-major), as a line writes it."""
    flat = col.reshape(-1)
    return np.where(flat, "true", "false").tolist() if col.dtype.kind == "b" else _number_texts(flat)


def _fill(pieces, holes, widths, steps, texts, n) -> str:
    # the lines' pieces laid out by slice assignment, then one join: no
    # Python frame and no tuple per line (half the cost of zipping them)
    size = len(pieces)
    parts = list(pieces) * n
    for at, k, j in holes:
        parts[at::size] = steps if k < 0 else texts[k][j::widths[k]] if widths[k] > 1 else texts[k]
    return "".join(parts)


@functools.lru_cache(maxsize=256)
def _template(path, kind, tags, tag_types, treedef, leaves):
    """A block line cut where its numbers go, out of the line :func:`_line`
    writes for a marked step and marked numbers (``tags``: total, lane
    and origin; ``tag_types``: their types, only part of the cache key;
    ``leaves``: each leaf's dtype and row shape):
    ``(pieces, holes, widths)``, where
    ``pieces[at]`` is None for each hole ``(at, k, j)``: number ``j`` of
    leaf ``k`` (``k`` -1: the step). None when the marks cannot be found
    unambiguously or a probe row's line differs from :func:`_line`'s."""
    total, lane, origin = tags[0], tags[1], tuple(tags[2:])
    widths = tuple(int(np.prod(shape, dtype=np.int64)) for _, shape in leaves)
    if not 0 < sum(widths) <= _MAX_WIDTH or 0 in widths or not _builtin_tree(treedef):
        return None
    marked, owners, used = [], {str(_STEP_MARK): (-1, 0)}, {"f": 0, "i": 0}
    for k, ((dtype, shape), width) in enumerate(zip(leaves, widths)):
        dtype = np.dtype(dtype)
        mark = "f" if dtype.kind == "f" else "i"  # (a bool leaf is marked as int32, then renamed)
        first, spacing = _VALUE_MARKS[mark]
        row = (first + spacing * np.arange(used[mark], used[mark] + width)).astype(
            np.int32 if dtype.kind == "b" else dtype)
        used[mark] += width
        owners.update((repr(v), (k, j)) for j, v in enumerate(row.tolist()))
        marked.append(row.reshape(shape) if shape else row[0])
    texts = list(owners)
    if len(texts) != 1 + sum(widths) or any(a != b and a in b for a in texts for b in texts):
        return None
    line = _line(make_event(path, _STEP_MARK, _unflatten(treedef, marked), total, kind, lane, origin))
    cut = re.split("(" + "|".join(map(re.escape, sorted(texts, key=len, reverse=True))) + ")", line)
    pieces = [None if i % 2 else piece for i, piece in enumerate(cut)]
    holes = tuple((i, *owners[piece]) for i, piece in enumerate(cut) if i % 2)
    seen = collections.Counter((k, j) for _, k, j in holes)
    if seen[(-1, 0)] != 1 or len(seen) != len(texts) or any(c != 2 for o, c in seen.items() if o[0] >= 0):
        return None
    for k, (dtype, _) in enumerate(leaves):  # a bool leaf's dtype, after its last number
        if np.dtype(dtype).kind == "b":
            at = max(i for i, owner, _ in holes if owner == k) + 1
            pieces[at] = pieces[at].replace('"dtype": "int32"', '"dtype": "bool"', 1)
    made = tuple(pieces), holes, widths
    return made if _probe_agrees(made, path, kind, total, lane, origin, treedef, leaves) else None


def _builtin_tree(treedef) -> bool:
    """Is the tree made of tuples, lists, dicts and namedtuples alone? A
    line writes those item by item; another node is written by ``repr``,
    whose layout depends on the values (numpy pads a column of numbers)."""
    if treedef is None:
        return True
    data = treedef.node_data()
    if data is not None and data[0] not in (tuple, list, dict) and not (
            isinstance(data[0], type) and issubclass(data[0], tuple) and hasattr(data[0], "_fields")):
        return False
    return all(_builtin_tree(child) for child in treedef.children())


def _unflatten(treedef, leaves):
    return leaves[0] if treedef is None else treedef.unflatten(leaves)


def _probe_agrees(made, path, kind, total, lane, origin, treedef, leaves) -> bool:
    """Does the template write a probe row as :func:`_line` does?"""
    cols = []
    for dtype, shape in leaves:
        dtype, width = np.dtype(dtype), int(np.prod(shape, dtype=np.int64))
        probe = np.arange(width) % 2 == 0 if dtype.kind == "b" else (np.arange(width) * 1.25 + 0.5).astype(dtype)
        cols.append(probe.reshape((1,) + tuple(shape)))
    row = [c[0] for c in cols]
    want = _line(make_event(path, 7, _unflatten(treedef, row), total, kind, lane, origin))
    return _fill(*made, ["7"], [_texts(c) for c in cols], 1) == want


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
        self.path = check_path("JSONLWriter", path,
                               "tap.JSONLWriter('run.jsonl') (to watch events on the console: on_step=print)")
        self._lock = threading.Lock()
        self._failed = False
        self._closed = False  # close() called: later events are dropped, said once
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
            self._dropped()
            return
        try:
            text = _block_text(block)
        except Exception:  # noqa: BLE001 - the general path below decides
            text = None
        if text is None:
            self._write(block.events())
        else:
            self._write((), text)

    def _dropped(self) -> None:
        if self._closed and not self._failed:
            self._failed = True
            warn_once_now(f"jax-tap: JSONLWriter({self.path!r}) received events after close(); they are "
                          "dropped. Close it after the block, or make a new JSONLWriter for each block.")

    def _write(self, events, text=None) -> None:
        if self._fh is None:
            self._dropped()
            return
        try:
            if text is None:
                text = "".join(map(_event_text, events))
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
            self._closed = True
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


def process_path(path, process: int) -> str:
    """The file process ``process`` writes for ``path``: ``run.jsonl`` ->
    ``run.p1.jsonl``."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.p{process}{ext}"
