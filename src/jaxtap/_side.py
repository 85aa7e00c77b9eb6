"""What a loop body ships to its driver: primitive-tap values as extra
outputs of its step (see :class:`Side`).

Example
-------
>>> import numpy as np
>>> from jaxtap._emit import Meta
>>> side = Side()
>>> side.add(Meta(None, "scan[0]/sin[0]", None, 3, "primitive"), np.float32(0.5))
>>> side.payloads(side.values)
[Array(0.5, dtype=float32)]
"""
from __future__ import annotations

import functools

import jax

from ._emit import Block, Meta, _split_payload


class Side:
    """Primitive-tap values that a loop carries out of its body.

    A primitive tap inside a loop body (buffered, or in a body with no
    callback of the user's: ``Walker.sides_for``) does not hop: its selected
    value becomes an extra output of the step (threaded out of any ``jit``
    or ``checkpoint`` around it), the runner carries the latest one, and the
    driver ships (or buffers) it with the loop's own events.

    ``rows``: how many copies of each value the outermost device buffer
    holds (its capacity, times the lengths of the blocks in between).
    """

    def __init__(self, rows=1):
        self.rows = rows
        self.entries = []  # (meta, static leaves, treedef, n leaves, n array leaves)
        self.values = []  # traced arrays, entry after entry

    def add(self, meta, value, fired=None):
        """Record ``value`` for ``meta``; with ``fired`` (traced bool), the
        event exists only where it is true."""
        if fired is not None:
            if isinstance(meta, Block) and not meta.gated:
                meta = Block(meta.metas, meta.layouts, meta.length, gated=True)
            elif not meta.gated:
                meta = Meta(meta.deliver, meta.path, meta.top, meta.total, meta.kind, gated=True,
                            backward=meta.backward, lanes=meta.lanes)
            value = (fired, value)
        dynamic, static, treedef, n = _split_payload(value)
        self.entries.append((meta, static, treedef, n, len(dynamic)))
        self.values.extend(dynamic)

    def extend(self, other, values):
        """Adopt a sub-trace's entries, with their values as seen out here."""
        self.entries.extend(other.entries)
        self.values.extend(values)

    @property
    def metas(self):
        return [e[0] for e in self.entries]

    @property
    def gated_only(self) -> bool:
        """Does every entry exist only where it fired (tripwires, taps in
        cond branches)? Then a step hops only where one fired."""
        return bool(self.entries) and all(meta.gated and 0 not in static and n_dyn
                                          for meta, static, _, _, n_dyn in self.entries)

    def any_fired(self, values):
        """Traced: did any entry fire (``gated_only``: each gated entry's
        flag leads its leaves)?"""
        flags, offset = [], 0
        for _, _, _, _, n_dyn in self.entries:
            flags.append(values[offset])
            offset += n_dyn
        return functools.reduce(jax.lax.bitwise_or, flags)

    def payloads(self, values):
        """Each entry's value rebuilt from ``values`` (laid out as ``self.values``)."""
        out, offset = [], 0
        for _, static, treedef, n, n_dyn in self.entries:
            it = iter(values[offset:offset + n_dyn])
            offset += n_dyn
            out.append(jax.tree_util.tree_unflatten(treedef, [static[i] if i in static else next(it)
                                                              for i in range(n)]))
        return out
