"""The rule registry both forms share, and the staging helpers rules use.

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

import numpy as np
from jax import lax

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
