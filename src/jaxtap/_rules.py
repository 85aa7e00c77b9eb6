"""The rule registry both forms share, the staging helpers rules use, and
:func:`observed`: how every rewritten loop stays out of differentiation.

A *rule* rewrites one equation of its primitive (``rule(walker, eqn,
params, invals, scope, site) -> outs``; ``eqn`` is None when the with-form
intercepts a bind). Rules are registered right under their definition,
keyed by the primitive object, as ``jax._src.checkify`` does::

    @register(_seam.scan_p)
    def handle_scan(walker, eqn, params, invals, scope, site): ...

``_transform`` registers the rules for bodies (jit, cond, remat, custom
calls, hijax), ``_loops`` those for scan and while. Both import this module;
neither imports the other's rules.
"""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import _seam
from ._emit import warn_where

RULES: dict = {}  # Primitive -> rule


def register(prim):
    """Register the decorated function as the rule for ``prim`` (None: skipped,
    for a primitive this JAX does not have)."""
    def decorate(rule):
        if prim is not None:
            RULES[prim] = rule
        return rule

    return decorate


def ruled_names() -> set:
    """Names of the primitives that have a rule (for name-keyed discovery)."""
    return {p.name for p in RULES}


# ------------------------------------------------------------------ helpers
def bind(eqn, prim, invals, params):
    """Bind ``prim`` as ``eqn`` was (its source info and context), or as the
    intercepted bind (``eqn`` None) would have been; always a list of outputs."""
    if eqn is None:
        out = _seam.bind_original(prim, invals, params)
        return list(out) if prim.multiple_results else [out]
    return _seam.bind_with_params(eqn, prim, invals, params)


_INT32 = None


def int32_aval():
    global _INT32
    if _INT32 is None:
        _INT32 = _seam.abstractify(np.int32(0))
    return _INT32


def bool_aval():
    return _seam.abstractify(np.bool_(True))


def one():
    return np.int32(1)


def both(a, b):
    """a AND b, where None means "always"."""
    if a is None or b is None:
        return b if a is None else a
    return lax.bitwise_and(a, b)


# ------------------------------------------------------------ differentiation
class _EventsOnly(threading.local):
    depth = 0


_EVENTS_ONLY = _EventsOnly()


def events_only() -> bool:
    """True while tracing a loop's events-only run (see :func:`observed`):
    the user's own debug callbacks fire in the loop JAX differentiates, so
    this run leaves them out (they would fire twice per step)."""
    return _EVENTS_ONLY.depth > 0


def _zero_tangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _tapped(tapped_fn):
    def tapped(*a):
        # JAX may trace this later, outside the interception; loops inside
        # it are observed, never differentiated, whatever the trace chain says
        with _seam.quiet(), _seam.differentiated(False):
            return list(tapped_fn(*a))

    return tapped


def _events_only(tapped_fn):
    """``tapped_fn`` run for its events alone (the user's debug callbacks
    left out), as one opaque equation to autodiff with zero tangents:
    partial evaluation (e.g. of jax.checkpoint) never looks inside it to
    recompute parts, which a while loop holding callbacks could not support."""
    tapped = _tapped(tapped_fn)

    def events_run(*a):
        _EVENTS_ONLY.depth += 1
        try:
            return tapped(*a)
        finally:
            _EVENTS_ONLY.depth -= 1

    events = jax.custom_jvp(events_run)

    def events_rule(primals, tangents):
        out = events(*primals)
        return out, [_zero_tangent(o) for o in out]

    events.defjvp(events_rule)
    return events


def shadowed(tapped_fn, plain_fn, args, check=True):
    """Evaluate ``plain_fn(*args)``, the user's loop as written, and run
    ``tapped_fn`` on the same (gradient-stopped) inputs for its events alone.

    For a loop whose tapped form XLA would compile otherwise than the
    user's own: one whose body holds primitive taps (a value the user's
    fusion keeps inside gets a second reader, and JAX 0.12.1's XLA:CPU
    contracts a multiply-add into one FMA only where the product has one),
    and a short scan (XLA unrolls a loop whose trip count it knows). The
    program's values are then its own by construction; the events come from
    the copy (which may round a last bit apart from the program's own run).
    Outside differentiation what follows the loop waits for the copy (an
    optimization barrier), so events keep the program's order. ``check``:
    compare the copy's outputs with the program's on device and warn once
    where they differ (not for a short scan, whose copy XLA does not unroll:
    it may differ in last bits by design).
    """
    seen = _events_only(tapped_fn)(*[jax.lax.stop_gradient(x) for x in args])
    outs = list(plain_fn(*args))
    token = [x for x in seen if _seam.is_plain_array(x)][:1]
    if not token or not outs or _seam.differentiating():
        return outs
    apart = _seam.bits_differ([(a, b) for a, b in zip(outs, seen) if _seam.is_plain_array(a)]) if check else None
    if apart is not None:
        warn_where(apart, "jax-tap: the events of a loop come from a copy of it (see README, \"Loops that run "
                          "twice\"), and this copy rounded apart from your program's own run: your program's "
                          "values are its own, bit for bit, but the events may differ from them in their last bits "
                          "(and, in a loop sensitive to them, in more).")
    return list(_seam.optimization_barrier((outs, token))[0])


def observed(tapped_fn, plain_fn, args):
    """Evaluate ``tapped_fn(*args)``; differentiate ``plain_fn`` instead.

    Both compute the same values; ``tapped_fn`` also emits. Under any
    differentiation the derivatives (and the primal outputs) are exactly
    those of ``plain_fn``, the user's untapped code, while ``tapped_fn``
    runs on gradient-stopped inputs for its events alone, without the
    user's ``jax.debug.callback``/``jax.debug.print`` equations (they fire
    once, in ``plain_fn``'s run, as they do untapped).

    Where an autodiff trace is active now (``jax.grad(f)`` eagerly, or
    traced inside a jit), ``plain_fn`` is bound as it is, so JAX
    differentiates it by the very rules it would use untapped (JAX >= 0.11
    linearizes a scan directly, which a JVP rule followed by partial
    evaluation does not reproduce bit for bit). Otherwise a ``custom_jvp``
    defers the choice to whatever transformation comes later.
    """
    tapped, events = _tapped(tapped_fn), _events_only(tapped_fn)
    if _seam.differentiating():
        events(*[jax.lax.stop_gradient(x) for x in args])
        return list(plain_fn(*args))

    f = jax.custom_jvp(tapped)

    def rule(primals, tangents):
        events(*[jax.lax.stop_gradient(p) for p in primals])
        # inputs without a tangent stay constants of the derivative, as they
        # are untapped (a rule may insist on symbolic zeros: lineax's solve)
        moving = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]

        def along(*moved):
            a = list(primals)
            for i, x in zip(moving, moved):
                a[i] = x
            return list(plain_fn(*a))

        return jax.jvp(along, [primals[i] for i in moving], [tangents[i] for i in moving])

    f.defjvp(rule, symbolic_zeros=True)
    return f(*args)
