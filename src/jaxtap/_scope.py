"""Addressing: where the walk is, and the numbers in a loop's path.

See README, "Addresses":

* a segment is ``name[index]``; loops are ``scan`` / ``while``, primitive
  taps use the primitive's name, ``jit`` marks a jitted function *inside* a
  loop body;
* inside a loop body, indices count occurrences of that name in the body,
  in program order; ``cond``/``switch`` branches, ``jax.checkpoint`` and
  ``custom_jvp``/``custom_vjp`` bodies are transparent (they continue the
  count of the body that holds them);
* outside any loop, jits are transparent too, and an index is the order in
  which *distinct source lines* first appear, so the same loop gets the same
  address on every call and in both the wrapping and the with-form.
"""
from __future__ import annotations

import weakref


class SiteIndex:
    """Top-level addressing: one index per distinct source site, per name."""

    def __init__(self):
        self._by_site: dict = {}
        self._next: dict = {}

    def peek(self, name, site):
        """The index :meth:`index` gives, without assigning one."""
        key = (name, site)
        return self._by_site[key] if key in self._by_site else self._next.get(name, 0)

    def __contains__(self, key):
        return key in self._by_site

    def index(self, name, site):
        key = (name, site)
        if key not in self._by_site:
            n = self._next.get(name, 0)
            self._by_site[key] = n
            self._next[name] = n + 1
        return self._by_site[key]


PROVISIONAL = "provisional"  # a top's third item: a custom rule's loop, numbered when its events arrive


class SitesBefore(tuple):
    """The sites a loop's jaxpr bound before it, hashed once: it rides in the
    loop's ``top``, which the router hashes on every hop (a tuple rehashes
    each of its items every time: 0.7 µs a hop after 50 loops)."""

    def __new__(cls, sites=()):
        self = super().__new__(cls, sites)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self):
        return self._hash


class TraceOrder:
    """The top-level loops each jaxpr's trace bound before each one.

    A block that reuses a compilation an equal-options block traced never
    saw its untapped loops (one ``where`` excluded, say); numbering the
    tapped ones as their events arrive would shift them. A loop's address
    carries the sites its jaxpr bound before it (the third item of its
    ``top``; ``_seam.current_trace`` says which trace: a nested jit's or a
    cond branch's own, as JAX caches those), and the router numbers those
    first, so the block's addresses are those it would give had it traced
    the program.

    Example
    -------
    >>> order, t = TraceOrder(), object.__new__(type("T", (), {}))
    >>> order.note("scan", "a.py:1", t), order.note("scan", "a.py:2", t), order.note("scan", "a.py:1", t)
    ((), ('a.py:1',), ())
    """

    def __init__(self):
        self._seen = weakref.WeakKeyDictionary()  # trace -> {name: [sites in order]}

    def note(self, name, site, trace):
        """The sites of ``name`` loops ``trace`` bound before ``site`` (None
        where the trace cannot be told apart)."""
        try:
            sites = self._seen.setdefault(trace, {}).setdefault(name, [])
        except TypeError:  # a trace without weak references: arrival order, as before
            return None
        if site not in sites:
            sites.append(site)
        return SitesBefore(sites[:sites.index(site)])


class OwnIndex:
    """The numbering of a top scope whose one loop the block numbers
    otherwise than the walker shared by equal-options blocks (it ran other
    programs first): the loop takes the block's own index, so ``where`` is
    asked of the block's address when the loop is traced."""

    def __init__(self, index):
        self._index = index

    def index(self, name, site):
        return self._index

    def save(self):
        return None

    def restore(self, saved):
        pass


class Counter:
    """Nested addressing: indices count occurrences in program order."""

    def __init__(self):
        self._next: dict = {}

    def index(self, name, site):
        n = self._next.get(name, 0)
        self._next[name] = n + 1
        return n

    def save(self):
        return dict(self._next)

    def restore(self, saved):
        self._next = dict(saved)


class Scope:
    """Where the walk is: address prefix, numbering, innermost loop's step."""

    __slots__ = ("prefix", "counter", "in_loop", "step", "total", "top", "differentiable", "side", "lane_running",
                 "backward", "recomputing", "sample_offset", "provisional", "before")

    def __init__(self, prefix, counter, in_loop, step, total, top=None, differentiable=True, side=None):
        self.prefix = prefix
        self.counter = counter
        self.in_loop = in_loop
        self.step = step  # traced int32 of the innermost loop, or None
        self.total = total
        self.top = top  # (name, site) of the outermost segment of `prefix`
        # False inside a runner, which JAX never differentiates: taps there may
        # use the vmap-aware single hop (it has no transpose rule)
        self.differentiable = differentiable
        # a Side collecting buffered primitive-tap values of this trace (set
        # by a buffered loop's step and by sub-traces that export to it)
        self.side = side
        # a while body's own predicate: under vmap, lanes that have finished
        # still run the body, and their primitive taps must stay silent
        self.lane_running = None
        # the innermost loop is a backward loop (cotangent taps): its step
        # counter k is forward step total-1-k, and its events say so
        self.backward = False
        # inside a backward loop's step, at any depth: forward loops here
        # recompute the forward pass and are never reported as a second one
        self.recomputing = False
        self.sample_offset = 0  # a backward loop's: its sampled counters are offset, offset + k, ...
        # in a custom_jvp/custom_vjp body: its top-level index is fixed only
        # when its events arrive (_routing.Router), so `where` is asked there
        self.provisional = False
        self.before = None  # a top scope's: the sites its program bound before this loop (TraceOrder)

    def address(self, name, site):
        """(path, top) of the next `name` node at this level."""
        seg = f"{name}[{self.counter.index(name, site)}]"
        if self.prefix:
            return f"{self.prefix}/{seg}", self.top
        # (a provisional top says so: the host asks `where` of its final path;
        # otherwise it names the loops its program bound before it: TraceOrder)
        if self.provisional:
            return seg, (name, site, PROVISIONAL)
        return seg, ((name, site) if self.before is None else (name, site, self.before))

    def child(self, prefix, counter, step, total, top, in_loop=True, differentiable=None, side=None, backward=None):
        child = Scope(prefix, counter, in_loop, step, total, top,
                      self.differentiable if differentiable is None else differentiable, side)
        child.backward = self.backward if backward is None else backward
        child.recomputing = self.recomputing or bool(backward)
        child.sample_offset = self.sample_offset if backward is None else 0
        child.provisional = self.provisional
        return child
