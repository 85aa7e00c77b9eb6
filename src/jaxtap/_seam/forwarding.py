"""Carry leaves (and scan outputs) that JAX's loop front ends took out.

``lax.scan`` and ``lax.while_loop`` move a carry leaf the body returns
unchanged out of the carry (it becomes a constant of the loop equation), and
``lax.scan`` drops an output that only repeats its ``xs``. The equation no
longer says where they were, but ``select`` must see the carry's leaves as
the body returns them (0.3.1, which wrapped ``lax.scan``, saw them all). So
while a block is active every loop bind notes what its front end moved
(:func:`note_forwarding`, read from the front end's frame), keyed by the body
jaxpr the equation keeps, and the loop rules put the leaves back
(:func:`forwarding_of`). ``vmap`` re-binds the loop with a batched body of
the same structure: the note follows it. A loop seen only in a form JAX
rebuilt otherwise (differentiated, partially evaluated) shows the leaves the
equation has, as before.

Example
-------
>>> Forwarded(carry=(True, False), ys=()).moved
1
"""
from __future__ import annotations

from typing import NamedTuple

from .eqns import loop_body, scan_p, scan_parts, while_parts
from .stack import _LOOPS_FILE, binder_frame

__all__ = ["Forwarded", "note_forwarding", "forwarding_of", "merge_forwarded"]

_FRONT_ENDS = {"scan", "while_loop"}
_BATCHING_RULES = {"_scan_batching_rule", "_while_loop_batching_rule"}
_MAX_NOTES = 4096


class Forwarded(NamedTuple):
    """What a loop's front end moved: ``carry[i]`` is True for a user carry
    leaf now among the equation's first constants (in order); ``ys[k]`` is
    None for a scan output the equation has, else the index (among the
    equation's ``xs``) of the input it repeats."""

    carry: tuple
    ys: tuple

    @property
    def moved(self) -> int:
        return sum(self.carry)


_NOTES: dict = {}  # id(body Jaxpr) -> (body Jaxpr, structure, Forwarded)


def _structure(prim, params):
    if prim is scan_p:
        _, nc, ncar, _ = scan_parts(params)
        return nc, ncar
    cond, cnc, body, bnc = while_parts(params)
    return bnc, len(body.out_avals)


def _remember(prim, params, forwarded):
    if len(_NOTES) > _MAX_NOTES:
        _NOTES.clear()
    body = loop_body(prim, params).jaxpr
    _NOTES[id(body)] = (body, _structure(prim, params), forwarded)


def note_forwarding(prim, params) -> None:
    """Note what the front end binding this loop moved (call from the bind)."""
    try:
        frame = binder_frame()
        if frame is None or not frame.f_code.co_filename.endswith(_LOOPS_FILE):
            return
        name, local = frame.f_code.co_name, frame.f_locals
        if name in _FRONT_ENDS:
            move = list(local.get("move_to_const") or ())
            ys = ()
            if prim is scan_p:
                ncar = len(move) - sum(move)  # the carries the equation keeps
                ys = tuple(None if f is None else f - ncar for f in (local.get("ext_to_ext_fwd") or ()))
            if any(move) or any(f is not None for f in ys):
                _remember(prim, params, Forwarded(tuple(move), ys))
        elif name in _BATCHING_RULES:  # vmap re-binds the same loop, batched
            source = local.get("jaxpr" if prim is scan_p else "body_jaxpr")
            hit = _NOTES.get(id(getattr(source, "jaxpr", None)))
            if hit is not None and hit[0] is source.jaxpr and hit[1] == _structure(prim, params):
                _remember(prim, params, hit[2])
    except Exception:  # noqa: BLE001 - a JAX whose front end differs: the leaves stay as the equation has them
        return


def forwarding_of(prim, params):
    """The :class:`Forwarded` noted for this loop equation, or None."""
    try:
        body = loop_body(prim, params).jaxpr
        hit = _NOTES.get(id(body))
        if hit is None or hit[0] is not body or hit[1] != _structure(prim, params):
            return None
        return hit[2]
    except Exception:  # noqa: BLE001
        return None


def merge_forwarded(forwarded, kept, moved_values):
    """The user's carry leaves: ``kept`` (the equation's carry) with the
    moved leaves (``moved_values``, the equation's first constants) back in
    their places."""
    kept, moved = iter(kept), iter(moved_values)
    return [next(moved) if m else next(kept) for m in forwarded.carry]
