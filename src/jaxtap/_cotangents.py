"""Cotangent taps (``backward=True``): what a backward loop's ``select``
sees, and how it runs.

A backward scan's carry is ``[accumulated cotangents of closed-over values,
cotangents of the forward carry leaves that have one]``; the seam
(``_seam.backward``) says how it maps onto the forward carry. Here that map
becomes the :class:`~jaxtap._emit.CarryLeaves` a select receives, and where
the forward loop was written under ``jax.vmap`` (and differentiated after
batching) the select runs per lane.
"""
from __future__ import annotations

import jax
import numpy as np

from . import _seam
from ._emit import CarryLeaves, run_select


def cotangent_view(info):
    """A backward scan's carry ``[params..., carry cotangents...]`` as its
    select sees it: :class:`CarryLeaves` in the forward carry's order."""
    def view(carry):
        params, cts = carry[:info.n_params], iter(carry[info.n_params:])
        leaves = [next(cts) if nz else _seam.zeros_of(aval) for aval, nz in zip(info.carry_avals, info.carry_nz)]
        return CarryLeaves(leaves, params)

    view.lanes = info.lanes if info.lanes and any(a is not None for a in info.lanes[1]) else None
    return view


def cotangent_select(p, view, carry, path):
    """A backward step's select. Where the forward loop was written under
    ``jax.vmap`` (and differentiated after batching), the select runs per
    lane, as it does forward, and the host splits the result by lane."""
    ct = view(carry)
    if not view.lanes:
        return run_select(p.select, p.select_path, ct, path)

    shape = {}

    def one(leaves, params):  # per lane; what is not an array (a path, a label) stays on the host
        out = run_select(p.select, p.select_path, CarryLeaves(leaves, params), path)
        flat, shape["tree"] = jax.tree_util.tree_flatten(out)
        shape["static"] = {i: x for i, x in enumerate(flat) if not _is_traceable(x)}
        return [x for i, x in enumerate(flat) if i not in shape["static"]]

    arrays = iter(jax.vmap(one, in_axes=(list(view.lanes[1]), None))(list(ct), tuple(ct.params)))
    static = shape["static"]
    return jax.tree_util.tree_unflatten(shape["tree"], [static[i] if i in static else next(arrays)
                                                        for i in range(shape["tree"].num_leaves)])


def _is_traceable(x) -> bool:
    """An array or a number (vmap can return it), not a string or an object."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex))
