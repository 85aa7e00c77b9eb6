"""The backward pass: which forward loop a transposed scan belongs to.

Reverse-mode differentiation of a scan runs in three of JAX's rules: the
scan's *linearization* (``jax.grad``, ``jax.vjp``) or *JVP* (under
``jax.checkpoint``, whose partial evaluation follows it) decides which carry
leaves have a tangent; the *transpose* of the tangent scan then binds the
backward scan, whose carry is ``[accumulated cotangents of the closed-over
values with a tangent, cotangents of the forward carry leaves with a
tangent]``. Dead-code elimination may drop tangent carry leaves in
between. While a lens asks for cotangent taps, jax-tap wraps those four
rules (the wrappers return exactly what the rules return) to learn, for each
backward scan, its forward twin's source site and how its carry maps onto
the forward carry: a :class:`BackwardInfo`, found again by
:func:`backward_info` from the backward scan's parameters. The tangent
scan's own body carries the exact map through elimination (its *lineage*);
where JAX stages it otherwise (``jax.checkpoint``), the forward twin's
record decides, by source site and types, and a backward scan whose map is
not certain stays a loop of its own address rather than be mislabelled.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import NamedTuple, Optional

from .eqns import scan_p, scan_parts
from .stack import bound_by_transpose, current_site, loop_site
from .versions import internal

__all__ = ["BackwardInfo", "backward_info", "note_backward_bind", "note_loop_as_written", "written_before",
           "install_backward_rules",
           "uninstall_backward_rules", "backward_rules_installed"]

_ad = internal("jax._src.interpreters.ad")
_pe = internal("jax._src.interpreters.partial_eval")


class BackwardInfo(NamedTuple):
    """How a backward scan maps onto its forward loop.

    ``forward_site``: the forward loop's site (as its address is keyed);
    ``carry_avals``: the forward carry's leaf types; ``carry_nz``: which of
    them have a cotangent in the backward carry (in order); ``n_params``:
    how many leading backward carry leaves accumulate the cotangents of
    closed-over values; ``lanes``: ``(B, axes)`` when the forward loop was
    written under ``jax.vmap`` (batched before it was differentiated): each
    forward carry leaf's lane axis (0, or None for a leaf all lanes share)."""

    forward_site: tuple
    carry_avals: tuple
    carry_nz: tuple
    n_params: int
    lanes: Optional[tuple] = None


class _Forward(NamedTuple):
    site: tuple  # the forward loop's site as its address is keyed (loop_site)
    carry_avals: tuple
    carry_nz: tuple


_RECENT = 256  # forward loops remembered (by source site) for their backward twins
_forwards: "collections.OrderedDict" = collections.OrderedDict()
_by_jaxpr: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # backward scan body -> BackwardInfo
# tangent scan body -> (forward loop, the forward carry leaf of each of its carry leaves)
_lineage: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_written: "collections.OrderedDict" = collections.OrderedDict()  # site -> carry avals as bound (per lane)
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
    """A forward scan was linearized (or JVP'd): which carry leaves have a
    tangent. Kept by source site for its backward twin; returns it."""
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
        return fwd
    except Exception:  # noqa: BLE001 - telemetry never breaks differentiation
        return None


def _note_lineage(jaxpr, fwd, leaves):
    """``jaxpr``'s scan carries forward carry leaves ``leaves`` of ``fwd``."""
    try:
        with _lock:
            _lineage[jaxpr] = (fwd, tuple(leaves))
    except TypeError:
        pass


def _lineage_of(jaxpr):
    try:
        with _lock:
            return _lineage.get(jaxpr)
    except TypeError:
        return None


def _linearize(is_vjp, nzs, *primals, **params):
    out = _originals["linearize"](is_vjp, nzs, *primals, **params)
    if _installed:
        try:
            fwd = _remember(params, out[1][:scan_parts(params)[2]])
            tangent = _closure_value(out[-1], "tangent_jaxpr")  # the tangent scan's body, bound later
            if fwd is not None and tangent is not None:
                _note_lineage(tangent, fwd, [i for i, nz in enumerate(fwd.carry_nz) if nz])
        except Exception:  # noqa: BLE001 - telemetry never breaks differentiation
            pass
    return out


def _closure_value(fn, name):
    """The value ``fn`` closes over as ``name``, or None."""
    try:
        return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))[name]
    except Exception:  # noqa: BLE001 - another JAX: the source site decides instead
        return None


def _jvp(primals, tangents, **params):
    out = _originals["jvp"](primals, tangents, **params)
    if _installed:
        try:
            ncar = scan_parts(params)[2]
            _remember(params, [not isinstance(t, _ad.Zero) for t in out[1][:ncar]])
        except Exception:  # noqa: BLE001 - telemetry never breaks differentiation
            pass
    return out


def _dce(*args):
    """Dead-code elimination drops a tangent scan's unused carry leaves: the
    pruned scan keeps the lineage of the leaves it still carries.
    (``(used_outputs, eqn)``; JAX >= 0.12: ``(used_outputs, live_ins, eqn)``.)"""
    used_inputs, new_eqn = _originals["dce"](*args)
    eqn = args[-1]
    if _installed and new_eqn is not None:
        try:
            known = _lineage_of(eqn.params.get("jaxpr"))
            if known is not None:
                _, nc, ncar, _ = scan_parts(eqn.params)
                kept = [leaf for leaf, used in zip(known[1], used_inputs[nc:nc + ncar]) if used]
                _note_lineage(new_eqn.params["jaxpr"], known[0], kept)
        except Exception:  # noqa: BLE001 - telemetry never breaks differentiation
            pass
    return used_inputs, new_eqn


def _transpose(cts, *args, **params):
    if not _installed:
        return _originals["transpose"](cts, *args, **params)
    prev = getattr(_HERE, "pending", None)
    try:
        _HERE.pending = (params, current_site())
    except Exception:  # noqa: BLE001 - the backward scan is then a stranger
        _HERE.pending = None
    try:
        return _originals["transpose"](cts, *args, **params)
    finally:
        _HERE.pending = prev


def note_backward_bind(params) -> None:
    """Called on every scan bind while the rules are wrapped: the scan that a
    transpose rule binds itself is a backward scan; remember what it maps to
    (a loop bound while the transposed body is traced, e.g. a checkpointed
    body's recomputed forward loop, is not)."""
    pending = getattr(_HERE, "pending", None)
    if pending is None or not bound_by_transpose():
        return
    _HERE.pending = None  # the transpose binds one scan
    try:
        info = _info(pending[0], pending[1], params)
        if info is not None:
            with _lock:
                _by_jaxpr[params["jaxpr"]] = info
    except Exception:  # noqa: BLE001 - the backward scan is then a stranger, as without the lens option
        pass


def _info(tparams, site, bparams) -> Optional[BackwardInfo]:
    """How the backward scan ``bparams`` (the transpose of ``tparams``, bound
    at ``site``) maps onto its forward loop; None when that is not certain
    (it then stays a loop of its own address)."""
    t_body, t_nc, t_ncar, _ = scan_parts(tparams)  # the scan being transposed: its carry is linear
    _, _, b_ncar, _ = scan_parts(bparams)
    n_params = b_ncar - t_ncar
    known = _lineage_of(tparams["jaxpr"])
    if known is not None and len(known[1]) == t_ncar:
        fwd, leaves = known
        nz = tuple(i in leaves for i in range(len(fwd.carry_avals)))
        return BackwardInfo(fwd.site, fwd.carry_avals, nz, n_params, _lanes(fwd, site))
    tangent_avals = list(t_body.in_avals[t_nc:t_nc + t_ncar])
    with _lock:
        candidates = _forwards.get(_unflagged(site), ())
    fits = [(fwd, _subsequence(fwd, tangent_avals)) for fwd in candidates]
    answers = {(fwd.site, fwd.carry_avals, nz): fwd for fwd, nz in fits if nz is not None and nz is not _MANY}
    if len(answers) == 1 and not any(nz is _MANY for _, nz in fits):
        (fsite, avals, nz), fwd = next(iter(answers.items()))
        return BackwardInfo(fsite, avals, nz, n_params, _lanes(fwd, site))
    if candidates:
        # forward twins whose layouts do not tell this one apart: a
        # stranger (its own address), never mislabelled
        return None
    # no forward loop seen (jax.linear_transpose): the transposed scan is the user's own
    avals = tuple(tangent_avals)
    return BackwardInfo(loop_site(scan_p, tparams, _unflagged(site)), avals, (True,) * t_ncar, n_params)


def note_loop_as_written(params, site) -> None:
    """A scan as the user wrote it (its carry per lane, when it is bound under
    ``jax.vmap``): what its linearized, batched twin is compared with."""
    try:
        body, nc, ncar, _ = scan_parts(params)
        with _lock:
            _written.pop(_unflagged(site), None)
            _written[_unflagged(site)] = tuple(body.in_avals[nc:nc + ncar])
            while len(_written) > _RECENT:
                _written.popitem(last=False)
    except Exception:  # noqa: BLE001
        pass


def _lanes(fwd, site):
    """``(B, axes)`` when the linearized forward carry is the written one
    batched along a leading lane axis of size B (vmap inside grad)."""
    with _lock:
        written = _written.get(_unflagged(site))
    if written is None or len(written) != len(fwd.carry_avals):
        return None
    size, axes = None, []
    for per_lane, batched in zip(written, fwd.carry_avals):
        lane_shape, shape = tuple(per_lane.shape), tuple(batched.shape)
        if shape == lane_shape:
            axes.append(None)
        elif len(shape) == len(lane_shape) + 1 and shape[1:] == lane_shape and size in (None, shape[0]):
            size = shape[0]
            axes.append(0)
        else:
            return None
    return None if size is None else (size, tuple(axes))


_MANY = object()  # more than one way: the layout cannot be told


def _subsequence(fwd, tangent_avals):
    """Which forward carry leaves the tangent carry holds: its tangent leaves
    as recorded, or (some pruned since) the only way to pick them by type;
    None when there is no such way, ``_MANY`` when there are several."""
    nz = fwd.carry_nz
    with_tangent = [i for i, z in enumerate(nz) if z]
    if len(with_tangent) == len(tangent_avals):
        if _same_types([fwd.carry_avals[i] for i in with_tangent], tangent_avals):
            return nz
        return None
    picks = _picks(with_tangent, [fwd.carry_avals[i] for i in with_tangent], tangent_avals, limit=2)
    if len(picks) != 1:
        return _MANY if picks else None
    return tuple(i in picks[0] for i in range(len(nz)))


def _picks(indices, avals, wanted, limit):
    """Up to ``limit`` ways to choose ``wanted``'s types, in order, from ``avals``."""
    if not wanted:
        return [()]
    out = []
    for k in range(len(avals) - len(wanted) + 1):
        if _same_types([avals[k]], wanted[:1]):
            for rest in _picks(indices[k + 1:], avals[k + 1:], wanted[1:], limit - len(out)):
                out.append((indices[k],) + rest)
                if len(out) >= limit:
                    return out
    return out


def _same_types(forward, tangent) -> bool:
    if len(forward) != len(tangent):
        return False
    return all(tuple(f.shape) == tuple(t.shape) and _tangent_dtype(f) == t.dtype for f, t in zip(forward, tangent))


def _tangent_dtype(aval):
    try:
        return aval.to_tangent_aval().dtype
    except Exception:  # noqa: BLE001
        return aval.dtype


def written_before(params, site) -> bool:
    """Was a scan from this site with this carry written in a forward pass?
    (Inside a backward step such a scan recomputes it.)"""
    try:
        body, nc, ncar, _ = scan_parts(params)
        with _lock:
            return _written.get(_unflagged(site)) == tuple(body.in_avals[nc:nc + ncar])
    except Exception:  # noqa: BLE001 - unknown: not a recomputation
        return False


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
             ("dce", getattr(_pe, "dce_rules", None), scan_p),
             ("transpose", transposes, scan_p)]
    node = getattr(_ad, "vjp_node", None)
    if node is not None and transposes is not None and scan_p is not None:
        slots.append(("transpose", transposes, node(scan_p)))
    return slots


_WRAPPERS = {"linearize": _linearize, "jvp": _jvp, "dce": _dce, "transpose": _transpose}


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
    with _lock:  # what one lens learnt never decides for the next one
        _forwards.clear()
        _written.clear()


def backward_rules_installed() -> bool:
    return bool(_installed)
