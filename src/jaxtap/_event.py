"""The one record type that crosses from device to host."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True, slots=True)
class TapEvent:
    """One observation: a loop step's carry, a scan's per-step output, or a
    primitive's output.

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
        ``"carry"``, ``"output"`` (scan ``ys``) or ``"primitive"``.
    lane : int or None
        Under ``jax.vmap``, the lane (batch index) this event belongs to;
        ``None`` when the shipped values were not batched.

    Examples
    --------
    >>> TapEvent("scan[0]", 3, 1.5, total=10)
    TapEvent(path='scan[0]', step=3, value=1.5, total=10, kind='carry')
    """

    path: str
    step: int
    value: Any
    total: Optional[int] = None
    kind: str = "carry"
    lane: Optional[int] = None

    def __repr__(self) -> str:
        lane = "" if self.lane is None else f", lane={self.lane}"
        return (f"TapEvent(path={self.path!r}, step={self.step!r}, value={self.value!r}, "
                f"total={self.total!r}, kind={self.kind!r}{lane})")


_new = object.__new__
_set = object.__setattr__


def make_event(path, step, value, total, kind, lane=None) -> TapEvent:
    """Build a TapEvent on the host's hot path (skips the frozen-dataclass
    ``__init__`` checks; equal to ``TapEvent(...)``)."""
    ev = _new(TapEvent)
    _set(ev, "path", path)
    _set(ev, "step", step)
    _set(ev, "value", value)
    _set(ev, "total", total)
    _set(ev, "kind", kind)
    _set(ev, "lane", lane)
    return ev
