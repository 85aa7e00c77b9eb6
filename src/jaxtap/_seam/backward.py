"""The backward pass: which forward loop a transposed scan belongs to.

Reverse-mode differentiation of a scan runs in three of JAX's rules: the
scan's *linearization* (``jax.grad``, ``jax.vjp``) or *JVP* (under
``jax.checkpoint``, whose partial evaluation follows it) decides which carry
leaves have a tangent; the *transpose* of the tangent scan then binds the
backward scan, whose carry is ``[accumulated cotangents of the closed-over
values with a tangent, cotangents of the forward carry leaves with a
tangent]``. While a lens asks for cotangent taps, jax-tap wraps those three
rules (the wrappers return exactly what the rules return) to learn, for each
backward scan, its forward twin's source site and how its carry maps onto
the forward carry: a :class:`BackwardInfo`, found again by
:func:`backward_info` from the backward scan's parameters.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import NamedTuple, Optional

from .eqns import scan_p, scan_parts
from .stack import current_site, loop_site
from .versions import internal

__all__ = ["BackwardInfo", "backward_info", "note_backward_bind", "install_backward_rules",
           "uninstall_backward_rules", "backward_rules_installed"]

_ad = internal("jax._src.interpreters.ad")


class BackwardInfo(NamedTuple):
    """How a backward scan maps onto its forward loop.

    ``forward_site``: the forward loop's site (as its address is keyed);
    ``carry_avals``: the forward carry's leaf types; ``carry_nz``: which of
    them have a cotangent in the backward carry (in order); ``n_params``:
    how many leading backward carry leaves accumulate the cotangents of
    closed-over values."""

    forward_site: tuple
    carry_avals: tuple
    carry_nz: tuple
    n_params: int


class _Forward(NamedTuple):
    site: tuple  # the forward loop's site as its address is keyed (loop_site)
    carry_avals: tuple
    carry_nz: tuple


_RECENT = 256  # forward loops remembered (by source site) for their backward twins
_forwards: "collections.OrderedDict" = collections.OrderedDict()
_by_jaxpr: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_HERE = threading.local()  # .pending: the scan a transpose rule is transposing
_lock = threading.Lock()
_originals: dict = {}  # rule name -> JAX's own rule (never dropped)
_installed: list = []  # (name, table, primitive, rule before) while wrapped


def _unflagged(site):
    """A site without its "backward" flag: the forward twin's key."""
    if isinstance(site, tuple) and len(site) > 3 and isinstance(site[3], bool):
        return site[:3] + (False,) + site[4:]
    return site


def _remember(params, carry_nz):
    try:
        body, nc, ncar, _ = scan_parts(params)
        site = current_site()
        fwd = _Forward(loop_site(scan_p, params, site), tuple(body.in_avals[nc:nc + ncar]), tuple(carry_nz))
        key = _unflagged(site)
        with _lock:
            seen = _forwards.pop(key, ())
            _forwards[key] = (fwd,) + tuple(f for f in seen if f != fwd)[:3]
            while len(_forwards) > _RECENT:
                _forwards.popitem(last=False)
    except Exception:  # noqa: BLE001 - telemetry never breaks differentiation
        pass


def _linearize(is_vjp, nzs, *primals, **params):
    out = _originals["linearize"](is_vjp, nzs, *primals, **params)
    if _installed:
        _remember(params, out[1][:scan_parts(params)[2]])
    return out


def _jvp(primals, tangents, **params):
    out = _originals["jvp"](primals, tangents, **params)
    if _installed:
        ncar = scan_parts(params)[2]
        _remember(params, [not isinstance(t, _ad.Zero) for t in out[1][:ncar]])
    return out


def _transpose(cts, *args, **params):
    if not _installed:
        return _originals["transpose"](cts, *args, **params)
    prev = getattr(_HERE, "pending", None)
    _HERE.pending = (params, current_site())
    try:
        return _originals["transpose"](cts, *args, **params)
    finally:
        _HERE.pending = prev


def note_backward_bind(params) -> None:
    """Called on every scan bind while the rules are wrapped: a scan bound by
    a transpose rule is a backward scan; remember what it maps to."""
    pending = getattr(_HERE, "pending", None)
    if pending is None or not _transposes(pending[0], params):
        return
    _HERE.pending = None  # the transpose binds one scan
    try:
        info = _info(pending[0], pending[1], params)
        if info is not None:
            with _lock:
                _by_jaxpr[params["jaxpr"]] = info
    except Exception:  # noqa: BLE001 - the backward scan is then a stranger, as without the lens option
        pass


def _transposes(tparams, bparams) -> bool:
    """Is ``bparams`` the transpose of ``tparams`` (and not a loop bound while
    the transposed body was traced, e.g. a checkpointed body's recomputed
    forward loop)?"""
    try:
        from .eqns import scan_reverse
        return (scan_parts(bparams)[3] == scan_parts(tparams)[3]
                and scan_reverse(bparams) != scan_reverse(tparams)
                and scan_parts(bparams)[2] >= scan_parts(tparams)[2])
    except Exception:  # noqa: BLE001
        return False


def _info(tparams, site, bparams) -> Optional[BackwardInfo]:
    _, _, t_ncar, _ = scan_parts(tparams)  # the scan being transposed: its carry is linear
    b_body, b_nc, b_ncar, _ = scan_parts(bparams)
    tangent_avals = [a for a in b_body.in_avals[b_nc + b_ncar - t_ncar:b_nc + b_ncar]]
    with _lock:
        candidates = _forwards.get(_unflagged(site), ())
    for fwd in candidates:
        nz = fwd.carry_nz
        if sum(nz) == t_ncar and _same_types([a for a, z in zip(fwd.carry_avals, nz) if z], tangent_avals):
            return BackwardInfo(fwd.site, fwd.carry_avals, nz, b_ncar - t_ncar)
    # no linearization seen (jax.linear_transpose): the transposed scan is the user's own
    t_body, t_nc, _, _ = scan_parts(tparams)
    avals = tuple(t_body.in_avals[t_nc:t_nc + t_ncar])
    return BackwardInfo(loop_site(scan_p, tparams, _unflagged(site)), avals, (True,) * t_ncar, b_ncar - t_ncar)


def _same_types(forward, tangent) -> bool:
    if len(forward) != len(tangent):
        return False
    return all(tuple(f.shape) == tuple(t.shape) and _tangent_dtype(f) == t.dtype for f, t in zip(forward, tangent))


def _tangent_dtype(aval):
    try:
        return aval.to_tangent_aval().dtype
    except Exception:  # noqa: BLE001
        return aval.dtype


def backward_info(params) -> Optional[BackwardInfo]:
    """The forward twin of a backward scan (by its parameters), or None."""
    try:
        with _lock:
            return _by_jaxpr.get(params["jaxpr"])
    except (TypeError, KeyError):
        return None


# ------------------------------------------------------------ installation
def _slots():
    """(rule name, rule table, primitive) of each rule wrapped. JAX >= 0.12
    binds a tangent scan under ``jax.vjp`` as ``vjp_node[scan]``, a
    primitive that copied scan's transpose rule when it was made."""
    transposes = getattr(_ad, "fancy_transposes", None)
    slots = [("linearize", getattr(_ad, "primitive_linearizations", None), scan_p),
             ("jvp", getattr(_ad, "primitive_jvps", None), scan_p),
             ("transpose", transposes, scan_p)]
    node = getattr(_ad, "vjp_node", None)
    if node is not None and transposes is not None and scan_p is not None:
        slots.append(("transpose", transposes, node(scan_p)))
    return slots


_WRAPPERS = {"linearize": _linearize, "jvp": _jvp, "transpose": _transpose}


def install_backward_rules() -> bool:
    """Wrap scan's linearize, JVP and transpose rules (idempotent). False on a
    JAX without them: backward scans then stay strangers."""
    if _installed:
        return True
    slots = _slots()
    if scan_p is None or any(table is None or prim not in table for _, table, prim in slots):
        return False
    for name, table, prim in slots:
        if table[prim] is not _WRAPPERS[name]:  # (a copy made while wrapped holds the wrapper)
            _originals.setdefault(name, table[prim])  # kept: a stale copy of a wrapper still works
        _installed.append((name, table, prim, table[prim]))
        table[prim] = _WRAPPERS[name]
    return True


def uninstall_backward_rules() -> None:
    while _installed:
        name, table, prim, before = _installed.pop()
        if table.get(prim) is _WRAPPERS[name]:
            table[prim] = before if before is not _WRAPPERS[name] else _originals[name]


def backward_rules_installed() -> bool:
    return bool(_installed)
