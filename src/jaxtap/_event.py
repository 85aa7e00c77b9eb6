"""The one record type that crosses from device to host."""
from __future__ import annotations

import dataclasses
from operator import itemgetter
from typing import Any, Optional

_FIELDS = ("path", "step", "value", "total", "kind", "lane", "shard", "device", "process", "backward")
TAG_FIELDS = _FIELDS[5:]  # lane, shard, device, process, backward: None unless the event has them
# (shard, device, process, backward) of a forward event from one device, one process
NO_ORIGIN = (None, None, None, None)
KINDS = ("carry", "output", "primitive", "compile", "trace", "cotangent")  # compile/trace: jit-event and trace-time taps
_tuple_new = tuple.__new__


@dataclasses.dataclass(frozen=True)
class _Shape:
    # Twin dataclass: lends TapEvent its field metadata, so dataclasses.fields,
    # replace and asdict work on events.
    path: str
    step: int
    value: Any
    total: Optional[int] = None
    kind: str = "carry"
    lane: Optional[int] = None
    shard: Optional[int] = None
    device: Optional[int] = None
    process: Optional[int] = None
    backward: Optional[bool] = None


class TapEvent(tuple):
    """One observation: a loop step's carry, a scan's per-step output, or a
    primitive's output.

    An immutable record. It behaves as a frozen dataclass
    (``dataclasses.replace`` / ``asdict`` / ``fields`` work on it) and is
    stored as a tuple, because the host builds one per delivered step and
    that is the cheapest record Python can build.

    Attributes
    ----------
    path : str
        Stable address of the observed node, e.g. ``"scan[0]/while[1]"`` or
        ``"scan[0]/jit[0]/cholesky[0]"``.
    step : int
        0-based iteration of the innermost enclosing loop (execution order,
        also for ``reverse=True`` scans); ``0`` outside any loop.
    value : Any
        Whatever ``select`` returned, with its pytree structure, as host
        numpy copies (0-d arrays arrive as numpy scalars).
    total : int or None
        Length of the enclosing scan; ``None`` for ``while`` loops; ``1``
        outside any loop.
    kind : str
        ``"carry"``, ``"output"`` (scan ``ys``), ``"primitive"`` or
        ``"cotangent"`` (a backward loop's step, ``backward=True``); with
        ``jit_events`` / ``trace_events``, ``"compile"`` (``step``: the
        function's compilations before this one) and ``"trace"`` (``step``:
        the loop's earlier tracings), whose ``value`` is a dict.
    lane : int or None
        Under ``jax.vmap``, the lane (batch index) this event belongs to;
        ``None`` when the shipped values were not batched.
    shard : int or None
        Inside ``jax.shard_map`` (and ``jax.pmap``), the shard that emitted
        this event: its index over the manual mesh axes (row-major in mesh
        axis order, as ``lax.axis_index(manual_axes)``), computed on device;
        ``None`` elsewhere.
    device : int or None
        With ``shard``, the ``jax.Device.id`` of the device that ran it
        (resolved on the host from the mesh); ``None`` elsewhere.
    process : int or None
        Under ``jax.distributed`` with more than one process, the
        ``jax.process_index()`` of the process that received the event;
        ``None`` in a single-process run.
    backward : bool or None
        ``True`` for an event of the backward pass (``backward=True``
        option): a ``"cotangent"`` event, or a primitive tap inside a
        backward loop; ``None`` otherwise.

    Examples
    --------
    >>> TapEvent("scan[0]", 3, 1.5, total=10)
    TapEvent(path='scan[0]', step=3, value=1.5, total=10, kind='carry')
    >>> TapEvent("scan[0]", 3, 1.5, total=10).step
    3
    """

    __slots__ = ()
    __match_args__ = _FIELDS
    __dataclass_fields__ = _Shape.__dataclass_fields__
    __dataclass_params__ = _Shape.__dataclass_params__

    path = property(itemgetter(0), doc="Address of the observed node.")
    step = property(itemgetter(1), doc="Iteration of the innermost enclosing loop.")
    value = property(itemgetter(2), doc="What ``select`` returned, as host copies.")
    total = property(itemgetter(3), doc="Scan length; None for while loops and outside any loop.")
    kind = property(itemgetter(4), doc='"carry", "output", "primitive", "compile" or "trace".')
    lane = property(itemgetter(5), doc="vmap lane, or None.")
    shard = property(itemgetter(6), doc="Shard index over shard_map's manual axes, or None.")
    device = property(itemgetter(7), doc="Id of the device that emitted it (with shard), or None.")
    process = property(itemgetter(8), doc="jax.process_index() in a multi-process run, or None.")
    backward = property(itemgetter(9), doc="True for an event of the backward pass, or None.")

    def __new__(cls, path: str, step: int, value: Any, total: Optional[int] = None,
                kind: str = "carry", lane: Optional[int] = None, shard: Optional[int] = None,
                device: Optional[int] = None, process: Optional[int] = None,
                backward: Optional[bool] = None) -> "TapEvent":
        return _tuple_new(cls, (path, step, value, total, kind, lane, shard, device, process, backward))

    def __getnewargs__(self):
        return tuple(self)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    # Equal only to another TapEvent (not to a plain tuple), and unordered,
    # as a dataclass would be.
    def __eq__(self, other):
        if type(other) is type(self):
            return tuple.__eq__(self, other)
        return False if isinstance(other, tuple) else NotImplemented

    def __ne__(self, other):
        if type(other) is type(self):
            return tuple.__ne__(self, other)
        return True if isinstance(other, tuple) else NotImplemented

    __hash__ = tuple.__hash__

    def __lt__(self, other):
        return NotImplemented

    __le__ = __gt__ = __ge__ = __lt__

    def __repr__(self) -> str:
        extra = "".join(f", {name}={self[i]!r}" for i, name in _OPTIONAL if self[i] is not None)
        return (f"TapEvent(path={self[0]!r}, step={self[1]!r}, value={self[2]!r}, "
                f"total={self[3]!r}, kind={self[4]!r}{extra})")


_OPTIONAL = tuple(enumerate(TAG_FIELDS, 5))  # shown by repr only when set


def make_event(path, step, value, total, kind, lane=None, origin=NO_ORIGIN) -> TapEvent:
    """Build a TapEvent on the host's hot path (equal to ``TapEvent(...)``,
    without the Python-level ``__new__`` call); ``origin`` is
    ``(shard, device, process, backward)``."""
    shard, device, process, backward = origin
    return _tuple_new(TapEvent, (path, step, value, total, kind, lane, shard, device, process, backward))
