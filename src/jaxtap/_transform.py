"""The transform: walk a jaxpr, rewrite loops and tapped primitives, re-emit.

A closed jaxpr is rewritten by *re-tracing an interpreter* over it: every
equation the user wrote is bound again with its own parameters, source info
and context (so XLA sees the user's arithmetic unchanged), while loops get an
extra int32 step counter in their carry and a tap at the end of their body.
One small handler per primitive family decides how to descend.

Addressing (which numbers a loop's path) is :mod:`._scope`.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from . import _seam
from ._cotangents import cotangent_select
from ._emit import CarryLeaves, Meta, TapSelectError, emit, finite_flag, run_select
from ._side import Side
from ._options import Plan, PrimTap
from ._scope import Counter, OwnIndex, Scope, SiteIndex
from ._rules import RULES, events_only, observed, register, ruled_names
from ._rules import bind as _bind, bool_aval as _bool_aval, both as _both, int32_aval as _int32_aval


class WhereError(TapSelectError):
    """The user's ``where`` raised: bad input, never a reason to run untapped
    (a :class:`TapSelectError`, so it is raised as every bad select is)."""


def _branch_ran(index, branch):
    """Did the cond whose branch index is ``index`` run ``branch``?"""
    return lax.eq(index, lax.convert_element_type(branch, index.dtype))


class Sinks:
    """Where the host halves deliver: set up by verbose() or record()."""

    def __init__(self, carry, ys, prims, guard):
        self.carry = carry  # deliver(event, top) for carry events
        self.ys = ys  # deliver(event, top) for scan-output events
        self.prims = prims  # list of deliver(event, top), one per PrimTap
        self.guard = guard


class Walker:
    """One rewrite configuration: a plan, its sinks, its top-level index."""

    def __init__(self, plan: Plan, sinks: Sinks, sites: SiteIndex):
        self.plan = plan
        self.sinks = sinks
        self.sites = sites
        self._needs: dict = {}
        self.eager: dict = {}  # loop equation -> its tapped, jitted twin (see _lens._eager_tapped)
        # (enclosing path, loop site) -> path of each nested forward loop, for
        # the backward loops that report at their forward twin's address
        self.forward_paths: dict = {}
        self._tap_names = plan.tapped_names
        self._births = [(i, t) for i, t in enumerate(plan.prim_taps) if t.prim is None]
        # with flush_every, a loop step collects what its body ships (primitive
        # taps, whole inner scans) for its driver to buffer; tripwires are not
        # buffered, they cross only when they trip
        self.buffers = plan.flush_every is not None
        # what ``where`` answered, by path (kept while it has chosen none: a
        # block whose ``where`` never matches says so at its exit)
        self.where_asked = {}

    # -------------------------------------------------------------- decisions
    def top_scope(self, sites=None, before=None, own=None):
        """The walk's outermost scope; ``sites``: number top-level loops there
        instead of in the walker's own index (a provisional scope: a
        custom rule's body, whose loops are numbered when their events
        arrive, ``where`` asked on the host). ``own``: the block's index
        for this scope's one top-level loop, where the walker numbers it
        otherwise (see ``_lens._intercept``). ``before``: the sites its
        program bound before it (``_scope.TraceOrder``)."""
        counter = OwnIndex(own) if own is not None else (self.sites if sites is None else sites)
        scope = Scope("", counter, False, None, 1)
        scope.provisional = sites is not None
        scope.before = before
        return scope

    def loop_wants(self, kind, path, provisional=False):
        """(carry?, ys?) this loop emits; (False, False) when it is silent.
        ``provisional``: ``path`` is not final yet; ``where`` is then asked
        of the final one, on the host (``_routing``)."""
        p = self.plan
        want_ys = p.emit_ys and kind == "scan"
        if not (p.emit_carry or want_ys) or not self._selected(kind, path, provisional):
            return (False, False)
        return (p.emit_carry, want_ys)

    def _selected(self, kind, path, provisional=False) -> bool:
        p = self.plan
        if kind not in p.kinds:
            return False
        if p.max_depth is not None and path.count("/") > p.max_depth:
            return False
        if p.where is not None:
            try:
                chosen = bool(p.where(path))  # (asked even of a provisional path: a broken where says so now)
            except Exception as exc:  # noqa: BLE001 - a broken where is bad input
                raise WhereError(f"jax-tap: your `where` raised on path {path!r}: {exc!r}. `where` takes a loop's "
                                 "path and returns True to tap it, e.g. where=lambda path: path == 'scan[0]'.") from None
            if not provisional and (len(self.where_asked) < 64 or chosen) and not any(self.where_asked.values()):
                self.where_asked[path] = chosen
            return chosen or provisional
        return True

    def needs(self, jaxpr) -> bool:
        """Does anything inside `jaxpr` need rewriting? (In an events-only
        run, a user's debug callback does: it is left out.)"""
        quiet = events_only()
        key = (id(jaxpr), quiet)
        hit = self._needs.get(key)
        if hit is not None and hit[0] is jaxpr:
            return hit[1]
        result = False
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in self._tap_names or (self._births and _seam.is_leaf_float_eqn(eqn)):
                result = True
            elif quiet and name in _seam.DEBUG_EFFECTS:
                result = True
            elif name in (_seam.SCAN, _seam.WHILE) and self.plan.emits_loops:
                result = True
            elif eqn.primitive in RULES or _seam.impl_of(eqn.primitive) is not None:
                result = any(self.needs(sub) for sub in _seam.subjaxprs_of(eqn.params, eqn))
            if result:
                break
        self._needs[key] = (jaxpr, result)
        return result

    def sides_for(self, body) -> bool:
        """Does a loop body ship its primitive taps (tripwires too) to the
        loop's driver, as extra outputs of its step (a ``_side.Side``)? Where
        buffered, and where the body has no effect of its own: its steps then
        run with no callback, compiled as the user's are (a body with the
        user's own callbacks emits in place, so they see its events live)."""
        return self.buffers or (bool(self.plan.prim_taps) and not body.effects)

    def taps_any(self, names) -> bool:
        """Would a primitive tap (or tripwire) fire on any of ``names``?"""
        return bool(self._births) or not self._tap_names.isdisjoint(names)

    def eqn_needs(self, eqn) -> bool:
        if eqn.primitive.name in (_seam.SCAN, _seam.WHILE) and self.plan.emits_loops:
            return True
        return any(self.needs(sub) for sub in _seam.subjaxprs_of(eqn.params, eqn))

    # -------------------------------------------------------------- rewriting
    def rewrite_closed(self, closed, scope_fn, extra_avals=()):
        """Re-trace `closed` through the interpreter (plus extra inputs)."""
        n = len(closed.in_avals)

        def fn(*args):
            scope = scope_fn(args[n:])
            return interpret(self, closed.jaxpr, closed.consts, args[:n], scope)

        return _seam.trace_closed(fn, list(closed.in_avals) + list(extra_avals))

    def rewrite_exporting(self, closed, scope_fn, extra_avals=(), rows=1):
        """:meth:`rewrite_closed` for a sub-trace of a buffered step: buffered
        primitive-tap values become extra outputs. Returns (closed, Side)."""
        n = len(closed.in_avals)
        side = Side(rows)

        def fn(*args):
            scope = scope_fn(args[n:])
            scope.side = side
            return list(interpret(self, closed.jaxpr, closed.consts, args[:n], scope)) + side.values

        return _seam.trace_closed(fn, list(closed.in_avals) + list(extra_avals)), side

    def loop_address(self, scope, site, length, prim_name="scan"):
        """(path, top) of a forward loop at ``scope``, remembered (with its
        length) for its backward twin."""
        path, top = scope.address(prim_name, site)
        if scope.prefix:
            if len(self.forward_paths) > 4096:
                self.forward_paths.clear()
            twins = self.forward_paths.setdefault((scope.prefix, site), {})
            twins[path] = length
        return path, top

    def backward_address(self, scope, forward_site, length):
        """(path, top) of a backward loop: its forward twin's address; None
        for a nested one whose twin cannot be told apart (two loops of one
        line and one length in one body)."""
        if not scope.prefix:
            return scope.address("scan", forward_site)
        twins = [p for p, n in self.forward_paths.get((scope.prefix, forward_site), {}).items() if n == length]
        return (twins[0], scope.top) if len(twins) == 1 else None

    def loop_parts(self, wants, path, top, total, view=None):
        """The events one loop step ships: (metas, payloads(carry, ys)).
        ``view``: a backward loop's map from its carry to what ``select``
        receives (its events are cotangent events)."""
        p = self.plan
        metas, selects = [], []
        if wants[0] and view is not None:
            metas.append(Meta(self.sinks.carry, path, top, total, "cotangent", backward=True,
                              lanes=view.lanes[0] if view.lanes else 0))
            selects.append(lambda carry, ys: cotangent_select(p, view, carry, path))
        elif wants[0]:
            metas.append(Meta(self.sinks.carry, path, top, total, "carry"))
            wrap = CarryLeaves if p.backward else tuple  # one select serves both directions
            selects.append(lambda carry, ys: run_select(p.select, p.select_path, wrap(carry), path))
        if wants[1]:
            metas.append(Meta(self.sinks.ys, path, top, total, "output"))
            selects.append(lambda carry, ys: run_select(p.select_ys, p.select_ys_path, ys, path,
                                                        what="scan outputs (ys)"))
        return metas, lambda carry, ys: [sel(carry, ys) for sel in selects]

    def emit_loop(self, wants, path, top, total, step, carry, ys=(), when=None, batched_hop=True):
        """One hop for a loop step: its carry event and/or its ys event."""
        if wants[1] and not ys:
            wants = (wants[0], False)  # a body returning (carry, None) has no outputs
        metas, payloads = self.loop_parts(wants, path, top, total)
        if metas:
            emit(metas, lambda: payloads(carry, ys), self.sinks.guard, step=step,
                 sample_every=self.plan.sample_every, when=when, batched_hop=batched_hop)

    def emit_prims(self, name, site, leaf_float, invals, outs, scope):
        """Primitive taps on one equation: one address, one hop per condition."""
        taps = [(i, t) for i, t in enumerate(self.plan.prim_taps) if t.prim == name]
        births = self._births if leaf_float else []
        if not taps and not births:
            return
        path, top = scope.address(name, site)
        # outside any loop there is no step (0.3.1: step -1, total None)
        step = scope.step if scope.step is not None else np.int32(-1)
        total = scope.total if scope.in_loop else None
        every = self.plan.sample_every if scope.step is not None else 1
        since = lax.sub(step, np.int32(scope.sample_offset)) if scope.sample_offset else step
        sampled = None if every == 1 else lax.eq(lax.rem(since, np.int32(every)), np.int32(0))
        metas, payloads = [], []
        for i, t in taps:
            # all outputs as a tuple, or output k as a bare array (0.3.1)
            chosen = tuple(outs) if t.output is None else _output(t, outs)
            meta = Meta(self.sinks.prims[i], path, top, total, "primitive", backward=scope.backward)
            if t.mode == "nan":  # a tripwire crosses to the host only when it trips
                flag = finite_flag(chosen if t.output is None else (chosen,))
                self._emit_when(lax.bitwise_not(flag), sampled, meta, step, scope, name, site)
            elif scope.side is not None:  # buffered: the loop's driver ships it
                scope.side.add(meta, _prim_payload(t, chosen, path)())
            else:
                metas.append(meta)
                payloads.append(_prim_payload(t, chosen, path))
        if metas:
            when = scope.lane_running
            if sampled is not None and (when is not None or scope.backward):
                when = _both(when, sampled)  # (a backward loop's steps are gated here, not on the host)
                every = 1
            emit(metas, lambda: [pf() for pf in payloads], self.sinks.guard, step=step, sample_every=every,
                 when=when, batched_hop=not scope.differentiable)
        for i, t in births:
            born = lax.bitwise_and(finite_flag(invals), lax.bitwise_not(finite_flag(outs)))
            meta = Meta(self.sinks.prims[i], path, top, total, "primitive", backward=scope.backward)
            self._emit_when(born, sampled, meta, step, scope, name, site)

    def _emit_when(self, flag, sampled, meta, step, scope, name, site):
        # a tripwire ships nothing but the fact; in the backward pass it names
        # the primitive and the user line whose derivative tripped it
        value = _seam.describe_site(name, site) if meta.backward else np.bool_(False)
        if scope.side is not None:  # in a loop body: its driver ships it where it fired
            scope.side.add(meta, value, fired=flag)
            return
        when = _both(_both(flag, sampled), scope.lane_running)
        emit([meta], lambda: [value], self.sinks.guard, step=step, sample_every=1, when=when,
             batched_hop=not scope.differentiable)


def _output(t: PrimTap, outs):
    """Output ``t.output`` of a tapped primitive; a clear error (at trace
    time, before anything runs) when the primitive has no such output."""
    n = len(outs)
    if not -n <= t.output < n:
        raise TapSelectError(
            f"jax-tap: the tap on {t.prim!r} asks for output={t.output}, but {t.prim} has {n} output"
            f"{'s' if n != 1 else ''}: use output={'0' if n == 1 else f'0..{n - 1}'}, or output=None for all.")
    return outs[t.output]


def _prim_payload(t: PrimTap, chosen, path):
    def payload():
        if t.mode == "nan":
            return np.bool_(False)  # only shipped when not finite
        if t.select is not None:
            what = f"outputs of {t.prim}" if t.output is None else None
            return run_select(t.select, t.select_path, chosen, path, what=what)
        return chosen

    return payload


# ------------------------------------------------------------------ interpreter
def interpret(walker: Walker, jaxpr, consts, args, scope: Scope):
    env = {}

    def read(v):
        return v.val if isinstance(v, _seam.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    quiet = events_only()
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        ours = _seam.staged_by_us(eqn)
        if ours == "tap" and not eqn.outvars:
            continue  # a stale emission from a cached, already-tapped trace
        if quiet and not eqn.outvars and eqn.primitive.name in _seam.DEBUG_EFFECTS:
            continue  # the user's own, in an events-only run: it fires in the differentiated loop
        handler = handler_for(eqn.primitive)
        if ours == "loop":
            outs = _seam.eval_eqn(eqn, invals)  # tapped already: never tap twice
        elif handler is not None and walker.eqn_needs(eqn):
            outs = handler(walker, eqn, eqn.params, invals, scope, _seam.site_of_eqn(eqn))
        else:
            outs = _seam.eval_eqn(eqn, invals)
        if eqn.primitive.name in walker._tap_names or walker._births:
            walker.emit_prims(eqn.primitive.name, _seam.site_of_eqn(eqn),
                              bool(walker._births) and _seam.is_leaf_float_eqn(eqn), invals, outs, scope)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, _seam.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


# ------------------------------------------------------------------ handlers
def _threaded(scope, branch_index=None):
    """(avals, values) a sub-trace gets as extra trailing inputs: the
    innermost step, the lane-running flag, and a cond's branch index."""
    avals, values = [], []
    if scope.step is not None:
        avals.append(_int32_aval())
        values.append(scope.step)
    if scope.lane_running is not None:
        avals.append(_bool_aval())
        values.append(scope.lane_running)
    if branch_index is not None:
        avals.append(_seam.abstractify(branch_index))
        values.append(branch_index)
    return avals, values


def _child_scope_fn(scope, prefix, counter, top=None, branch=None):
    """The scope of a sub-trace from its extra inputs (see _threaded). Inside
    branch ``branch`` of a cond, ``lane_running`` also says "this branch ran": under
    vmap a cond on a batched predicate runs every branch for every lane."""
    has_step, has_lane_running = scope.step is not None, scope.lane_running is not None

    def make(extra):
        step = extra[0] if has_step else None
        child = scope.child(prefix, counter, step, scope.total, top or scope.top, in_loop=scope.in_loop)
        lane_running = extra[int(has_step)] if has_lane_running else None
        if branch is not None and scope.in_loop:
            lane_running = _both(lane_running, _branch_ran(extra[-1], branch))
        child.lane_running = lane_running
        return child

    return make


def _rewrite_sub(walker, closed, scope, scope_fn, extra_avals):
    """Rewrite a sub-trace (jit / checkpoint body); inside a buffered step its
    buffered primitive-tap values come out as extra trailing outputs.
    Returns (closed, Side or None)."""
    if scope.side is None:
        return walker.rewrite_closed(closed, scope_fn, extra_avals), None
    return walker.rewrite_exporting(closed, scope_fn, extra_avals, scope.side.rows)


def _adopt(scope, side, outs):
    """Split a sub-trace's outputs from its exported values (see _rewrite_sub)."""
    if side is None or not side.entries:  # (an empty select's entries ship no values, yet exist)
        return outs
    n = len(outs) - len(side.values)
    scope.side.extend(side, outs[n:])
    return outs[:n]


@register(_seam.jit_p)
def handle_jit(walker, eqn, params, invals, scope, site):
    body = _seam.jit_body(params)
    if scope.in_loop:
        (prefix, top), counter = scope.address("jit", site), Counter()
    else:
        prefix, top, counter = scope.prefix, scope.top, scope.counter
    avals, values = _threaded(scope)
    new_body, side = _rewrite_sub(walker, body, scope, _child_scope_fn(scope, prefix, counter, top), avals)
    new_params = _seam.jit_with_body(params, new_body, extra_inputs=len(values),
                                     extra_outputs=len(side.values) if side else 0)
    outs = _bind(eqn, _seam.jit_p, list(invals) + values, new_params)
    return _adopt(scope, side, outs)


@register(_seam.cond_p)
def handle_cond(walker, eqn, params, invals, scope, site):
    branches = _seam.cond_branches(params)
    extra, values = _threaded(scope, invals[0] if scope.in_loop else None)
    fns = [_child_scope_fn(scope, scope.prefix, scope.counter, branch=b) for b in range(len(branches))]
    args = list(invals) + values
    if scope.side is None:
        new = [walker.rewrite_closed(br, fn, extra) for br, fn in zip(branches, fns)]
        return _bind(eqn, _seam.cond_p, args, _seam.cond_with_branches(params, new))
    saved = scope.counter.save()
    first = [walker.rewrite_exporting(br, fn, extra, scope.side.rows) for br, fn in zip(branches, fns)]
    if not any(side.entries for _, side in first):  # entries, not values: see _adopt
        return _bind(eqn, _seam.cond_p, args, _seam.cond_with_branches(params, [c for c, _ in first]))
    return _buffered_cond(walker, eqn, params, args, scope, fns, extra, saved,
                          [list(c.out_avals[len(br.out_avals):]) for (c, _), br in zip(first, branches)])


def _buffered_cond(walker, eqn, params, args, scope, scope_fns, extra, saved, regions):
    """A cond whose branches hold buffered primitive taps: every branch
    returns every branch's values (its own; unspecified for the others), and
    each value is kept with "this branch ran" as its condition."""
    scope.counter.restore(saved)  # the second tracing numbers nodes as the first did
    branches, sides = _seam.cond_branches(params), []

    def padded(b, br):
        n = len(br.in_avals)

        def fn(*a):
            inner = scope_fns[b](a[n:])
            inner.side = side = Side(scope.side.rows)
            outs = interpret(walker, br.jaxpr, br.consts, a[:n], inner)
            sides.append(side)
            pads = [side.values if c == b else [_seam.empty_like(av) for av in region]
                    for c, region in enumerate(regions)]
            return list(outs) + [v for pad in pads for v in pad]

        return _seam.trace_closed(fn, list(br.in_avals) + extra)

    new = [padded(b, br) for b, br in enumerate(branches)]
    outs = _bind(eqn, _seam.cond_p, args, _seam.cond_with_branches(params, new))
    n_out = len(branches[0].out_avals)
    rest, index = outs[n_out:], args[0]
    for c, side in enumerate(sides):
        mine, rest = rest[:len(regions[c])], rest[len(regions[c]):]
        ran = _branch_ran(index, c)
        for (meta, *_), value in zip(side.entries, side.payloads(mine)):
            if meta.gated:  # already gated by a cond inside this branch
                fired, value = value
                scope.side.add(meta, value, fired=lax.bitwise_and(ran, fired))
            else:
                scope.side.add(meta, value, fired=ran)
    return outs[:n_out]


@register(_seam.remat_p)
def handle_remat(walker, eqn, params, invals, scope, site):
    avals, values = _threaded(scope)
    closed, side = _rewrite_sub(walker, _seam.remat_body(params), scope,
                                _child_scope_fn(scope, scope.prefix, scope.counter), avals)
    new_params, consts = _seam.remat_with_body(params, closed)
    args = list(consts) + list(invals) + values
    return _adopt(scope, side, _bind(eqn, _seam.remat_p, args, new_params))


if _seam.shard_map_p is not None:
    @register(_seam.shard_map_p)
    def handle_shard_map(walker, eqn, params, invals, scope, site):
        """A shard_map inside a tapped loop: its body is rewritten with its
        axes manual (as shard_map traces it), the enclosing step threaded in
        replicated. Inside a buffered step its loops stay silent."""
        if scope.side is not None:
            return _bind(eqn, _seam.shard_map_p, list(invals), params)
        avals, values = _threaded(scope)
        with _seam.inside_shard_map(params):
            # (its body: an open jaxpr under "jaxpr", read as remat's is)
            closed = walker.rewrite_closed(_seam.remat_body(params), _child_scope_fn(scope, scope.prefix,
                                                                                     scope.counter), avals)
        jaxpr, consts = _seam.open_with_const_inputs(closed)
        new_params = _seam.shard_map_with_body(params, jaxpr, len(consts), len(values))
        return _bind(eqn, _seam.shard_map_p, list(consts) + list(invals) + values, new_params)


def _handle_call(prim):
    def handle(walker, eqn, params, invals, scope, site):
        # Custom-derivative bodies keep their signature (their rules are
        # untouched), so the step is not threaded in: see README boundaries.
        inner = scope.child(scope.prefix, scope.counter, None, scope.total, scope.top, in_loop=scope.in_loop)
        body = walker.rewrite_closed(_seam.call_body(params), lambda extra: inner)
        return _bind(eqn, prim, invals, _seam.call_with_body(params, body))

    return handle


def _expanded(walker, eqn, prim, params, invals, scope, expanded):
    """A primitive that expands into equations (loops included) only when
    lowered: its expansion is interpreted, as transparent as a call, while
    derivatives (and batching) stay the primitive's own rules."""
    if expanded is None:
        return _bind(eqn, prim, invals, params)
    if scope.side is not None:
        # a buffered step (never differentiated): the expansion runs inline,
        # and its loops' and taps' events ride in the step's buffer
        return interpret(walker, expanded.jaxpr, expanded.consts, list(invals), scope)
    inner = scope.child(scope.prefix, scope.counter, None, scope.total, scope.top, in_loop=scope.in_loop)

    def tapped(*args):
        return interpret(walker, expanded.jaxpr, expanded.consts, list(args), inner)

    def plain(*args):
        return _bind(eqn, prim, list(args), params)

    return observed(tapped, plain, list(invals))


@register(_seam.hi_call_p)
def handle_hi(walker, eqn, params, invals, scope, site):
    """A hijax primitive (JAX >= 0.11): its ``expand`` stages the equations."""
    return _expanded(walker, eqn, _seam.hi_call_p, params, invals, scope, _seam.hi_expansion(params))


for _prim in (_seam.custom_jvp_call_p, _seam.custom_vjp_call_p, _seam.closed_call_p):
    register(_prim)(_handle_call(_prim))


def _handle_impl(prim):
    def handle(walker, eqn, params, invals, scope, site):
        """A library primitive lowered by tracing its implementation (Equinox's
        ``create_vprim``: lineax's ``linear_solve``)."""
        avals = [v.aval for v in eqn.invars] if eqn is not None else [_seam.abstractify(x) for x in invals]
        return _expanded(walker, eqn, prim, params, invals, scope, _seam.impl_expansion(prim, params, avals, eqn))

    return handle


def handler_for(prim):
    """The rule for an equation of ``prim``, or None (re-emitted unchanged)."""
    handler = RULES.get(prim)
    if handler is None and _seam.impl_of(prim) is not None:
        handler = _handle_impl(prim)
    return handler


def tappable_names(jaxpr) -> dict:
    """Primitive name -> count of what the walker can reach (and so tap):
    loop bodies, branches, jits, checkpoints, custom-derivative bodies,
    ``shard_map`` bodies; never the inside of a primitive it binds unchanged
    (a linear solve's operator, ``pallas_call``)."""
    return _seam.collect_names(jaxpr, into=ruled_names())
