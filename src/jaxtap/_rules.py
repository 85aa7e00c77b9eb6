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
    def tapped(*a):
        # JAX may trace this later, outside the interception; loops inside
        # it are observed, never differentiated, whatever the trace chain says
        with _seam.quiet(), _seam.differentiated(False):
            return list(tapped_fn(*a))

    def events_run(*a):
        _EVENTS_ONLY.depth += 1
        try:
            return tapped(*a)
        finally:
            _EVENTS_ONLY.depth -= 1

    # The events-only run is one opaque equation to autodiff: partial
    # evaluation (e.g. of jax.checkpoint) never looks inside it to recompute
    # parts, which a while loop holding callbacks could not support.
    events = jax.custom_jvp(events_run)

    def events_rule(primals, tangents):
        out = events(*primals)
        return out, [_zero_tangent(o) for o in out]

    events.defjvp(events_rule)

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
