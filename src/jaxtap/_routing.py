"""Host routing: which receiver a hop's events go to, under which address.

A block's events go, when they arrive, to the innermost active block of its
token; a call scope's go straight to its wrapper. Routes are cached per
address and invalidated whenever the active blocks change.
"""
from __future__ import annotations

import dataclasses
import weakref

from ._scope import PROVISIONAL

_MAX_ROUTES = 4096  # cached routes per router (addresses x kinds); cleared when full


class Router:
    """Host routing: deliver to ``find()`` (a block or a wrapped function
    with ``_sites``, ``_plan``, ``_consumers``, ``_prims``; None drops).

    The outermost index of an address is the receiver's own: the n-th
    distinct top-level loop (by source line) it met, so a block's addresses
    do not depend on what earlier blocks with the same configuration ran.
    """

    def __init__(self, find, registry):
        self._find, self._registry = find, registry
        # (path, kind, top) -> (registry generation, weakref(receiver), path):
        # a hop's route is looked up once per change of the active blocks
        self._routes = {}

        def carry_sink(event, top):
            self.carry(event, top)

        carry_sink.resolve = self._resolve_carry  # buffered batches route once
        self.carry_sink = carry_sink

    def _route(self, path, kind, top):
        """(receiver, path as it names it), or (None, None) to drop."""
        key = (path, kind, top)
        generation = self._registry.generation
        hit = self._routes.get(key)
        if hit is not None and hit[0] == generation:
            ctx = hit[1]()
            if ctx is not None:
                return ctx, hit[2]
        ctx, named = self._find_route(path, kind, top)
        if ctx is not None:
            if len(self._routes) > _MAX_ROUTES:
                self._routes.clear()
            self._routes[key] = (generation, weakref.ref(ctx), named)
        return ctx, named

    def _find_route(self, path, kind, top):
        ctx = self._find()
        if ctx is None:
            return None, None
        if top is not None:
            first, sep, rest = path.partition("/")
            sites, provisional = ctx._sites, len(top) > 2 and top[2] == PROVISIONAL
            if len(top) > 2 and not provisional and top[:2] not in sites:
                for earlier in top[2]:  # a program this block never traced: its loops before this one first
                    sites.index(top[0], earlier)
            mine = f"{top[0]}[{sites.index(top[0], top[1])}]"
            if mine != first or provisional:  # renamed, or a provisional loop's (where not asked yet)
                path = mine + sep + rest
                where = ctx._plan.where
                if where is not None and kind != "primitive" and not _safe_where(where, path):
                    return None, None
        return ctx, path

    def _receive(self, event, top):
        ctx, path = self._route(event.path, event.kind, top)
        if ctx is not None and path != event.path:
            event = dataclasses.replace(event, path=path)
        return ctx, event

    def carry(self, event, top):
        ctx, event = self._receive(event, top)
        if ctx is not None:
            ctx._consumers.deliver(event)  # carry or output, by kind

    def _resolve_carry(self, path, kind, top):
        ctx, path = self._route(path, kind, top)
        if ctx is None:
            return None
        consumers = ctx._consumers
        return (consumers.ys_sink if kind == "output" else consumers.carry_sink), path

    def prim(self, i):
        def deliver(event, top):
            ctx, event = self._receive(event, top)
            if ctx is not None:
                ctx._prims[i].deliver(event)

        def resolve(path, kind, top):
            ctx, path = self._route(path, kind, top)
            return None if ctx is None else (ctx._prims[i].deliver, path)

        deliver.resolve = resolve
        return deliver


def _safe_where(where, path):
    try:
        return bool(where(path))
    except Exception:  # noqa: BLE001
        return False
