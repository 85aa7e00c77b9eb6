"""The transform: walk a jaxpr, rewrite loops and tapped primitives, re-emit.

A closed jaxpr is rewritten by *re-tracing an interpreter* over it: every
equation the user wrote is bound again with its own parameters, source info
and context (so XLA sees the user's arithmetic unchanged), while loops get an
extra int32 step counter in their carry and a tap at the end of their body.
One small handler per primitive family decides how to descend.

Addressing (see README, "Addresses"):

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

import numpy as np
from jax import lax

from . import _seam
from ._emit import Buffer, Meta, emit, finite_flag, run_select
from ._options import Plan, PrimTap

_INT32 = None


def _int32_aval():
    global _INT32
    if _INT32 is None:
        _INT32 = _seam.abstractify(np.int32(0))
    return _INT32


class SiteIndex:
    """Top-level addressing: one index per distinct source site, per name."""

    def __init__(self):
        self._by_site: dict = {}
        self._next: dict = {}

    def index(self, name, site):
        key = (name, site)
        if key not in self._by_site:
            n = self._next.get(name, 0)
            self._by_site[key] = n
            self._next[name] = n + 1
        return self._by_site[key]


class Counter:
    """Nested addressing: indices count occurrences in program order."""

    def __init__(self):
        self._next: dict = {}

    def index(self, name, site):
        n = self._next.get(name, 0)
        self._next[name] = n + 1
        return n


class Scope:
    """Where the walk is: address prefix, numbering, innermost loop's step."""

    __slots__ = ("prefix", "counter", "in_loop", "step", "total", "top", "diff")

    def __init__(self, prefix, counter, in_loop, step, total, top=None, diff=True):
        self.prefix = prefix
        self.counter = counter
        self.in_loop = in_loop
        self.step = step  # traced int32 of the innermost loop, or None
        self.total = total
        self.top = top  # (name, site) of the outermost segment of `prefix`
        # False inside a runner, which JAX never differentiates: taps there may
        # use the vmap-aware single hop (it has no transpose rule)
        self.diff = diff

    def address(self, name, site):
        """(path, top) of the next `name` node at this level."""
        seg = f"{name}[{self.counter.index(name, site)}]"
        if self.prefix:
            return f"{self.prefix}/{seg}", self.top
        return seg, (name, site)

    def child(self, prefix, counter, step, total, top, in_loop=True, diff=None):
        return Scope(prefix, counter, in_loop, step, total, top, self.diff if diff is None else diff)


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
        self._tap_names = plan.tapped_names
        self._births = [(i, t) for i, t in enumerate(plan.prim_taps) if t.prim is None]

    # -------------------------------------------------------------- decisions
    def top_scope(self):
        return Scope("", self.sites, False, None, 1)

    def loop_wants(self, kind, path):
        """(carry?, ys?) this loop emits; (False, False) when it is silent."""
        p = self.plan
        want_ys = p.emit_ys and kind == "scan"
        if not (p.emit_carry or want_ys) or not self._selected(kind, path):
            return (False, False)
        return (p.emit_carry, want_ys)

    def _selected(self, kind, path) -> bool:
        p = self.plan
        if kind not in p.kinds:
            return False
        if p.max_depth is not None and path.count("/") > p.max_depth:
            return False
        if p.where is not None:
            try:
                return bool(p.where(path))
            except Exception as exc:  # noqa: BLE001 - a broken where is bad input
                raise TypeError(f"jax-tap: your `where` raised on path {path!r}: {exc!r}") from None
        return True

    def needs(self, jaxpr) -> bool:
        """Does anything inside `jaxpr` need rewriting?"""
        key = id(jaxpr)
        hit = self._needs.get(key)
        if hit is not None and hit[0] is jaxpr:
            return hit[1]
        result = False
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in self._tap_names or (self._births and _seam.is_leaf_float_eqn(eqn)):
                result = True
            elif name in (_seam.SCAN, _seam.WHILE) and self.plan.emits_loops:
                result = True
            elif name in HANDLERS:
                result = any(self.needs(sub) for sub in _seam.subjaxprs_of(eqn.params))
            if result:
                break
        self._needs[key] = (jaxpr, result)
        return result

    def eqn_needs(self, eqn) -> bool:
        if eqn.primitive.name in (_seam.SCAN, _seam.WHILE) and self.plan.emits_loops:
            return True
        return any(self.needs(sub) for sub in _seam.subjaxprs_of(eqn.params))

    # -------------------------------------------------------------- rewriting
    def rewrite_closed(self, closed, scope_fn, extra_avals=()):
        """Re-trace `closed` through the interpreter (plus extra inputs)."""
        n = len(closed.in_avals)

        def fn(*args):
            scope = scope_fn(args[n:])
            return interpret(self, closed.jaxpr, closed.consts, args[:n], scope)

        return _seam.trace_closed(fn, list(closed.in_avals) + list(extra_avals))

    def loop_parts(self, wants, path, top, total):
        """The events one loop step ships: (metas, payloads(carry, ys))."""
        p = self.plan
        metas, selects = [], []
        if wants[0]:
            metas.append(Meta(self.sinks.carry, path, top, total, "carry"))
            selects.append(lambda carry, ys: run_select(p.select, p.select_path, carry, path))
        if wants[1]:
            metas.append(Meta(self.sinks.ys, path, top, total, "output"))
            selects.append(lambda carry, ys: run_select(p.select_ys, p.select_ys_path, ys, path,
                                                        what="scan outputs (ys)"))
        return metas, lambda carry, ys: [sel(carry, ys) for sel in selects]

    def emit_loop(self, wants, path, top, total, step, carry, ys=(), valid=None, batched_hop=True):
        """One hop for a loop step: its carry event and/or its ys event."""
        if wants[1] and not ys:
            wants = (wants[0], False)  # a body returning (carry, None) has no outputs
        metas, payloads = self.loop_parts(wants, path, top, total)
        if metas:
            emit(metas, lambda: payloads(carry, ys), self.sinks.guard, step=step,
                 sample_every=self.plan.sample_every, valid=valid, batched_hop=batched_hop)

    def emit_prims(self, name, site, leaf_float, invals, outs, scope):
        """Primitive taps on one equation: one address, one hop per gate."""
        taps = [(i, t) for i, t in enumerate(self.plan.prim_taps) if t.prim == name]
        births = self._births if leaf_float else []
        if not taps and not births:
            return
        path, top = scope.address(name, site)
        step = scope.step if scope.step is not None else np.int32(0 if not scope.in_loop else -1)
        every = self.plan.sample_every if scope.step is not None else 1
        sampled = None if every == 1 else lax.eq(lax.rem(step, np.int32(every)), np.int32(0))
        metas, payloads = [], []
        for i, t in taps:
            chosen = tuple(outs) if t.output is None else (outs[t.output],)
            meta = Meta(self.sinks.prims[i], path, top, scope.total, "primitive")
            if t.mode == "nan":  # a tripwire crosses to the host only when it trips
                self._emit_when(lax.bitwise_not(finite_flag(chosen)), sampled, meta, step, scope)
            else:
                metas.append(meta)
                payloads.append(_prim_payload(t, chosen, path))
        if metas:
            emit(metas, lambda: [pf() for pf in payloads], self.sinks.guard, step=step, sample_every=every,
                 batched_hop=not scope.diff)
        for i, t in births:
            born = lax.bitwise_and(finite_flag(invals), lax.bitwise_not(finite_flag(outs)))
            meta = Meta(self.sinks.prims[i], path, top, scope.total, "primitive")
            self._emit_when(born, sampled, meta, step, scope)

    def _emit_when(self, flag, sampled, meta, step, scope):
        valid = flag if sampled is None else lax.bitwise_and(flag, sampled)
        emit([meta], lambda: [np.bool_(False)], self.sinks.guard, step=step, sample_every=1, valid=valid,
             batched_hop=not scope.diff)


def _prim_payload(t: PrimTap, chosen, path):
    def payload():
        if t.mode == "nan":
            return np.bool_(False)  # only shipped when not finite
        if t.select is not None:
            return run_select(t.select, False, chosen, path, what=f"outputs of {t.prim}")
        return chosen[0] if len(chosen) == 1 else chosen

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
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        ours = _seam.staged_by_us(eqn)
        if ours == "tap" and not eqn.outvars:
            continue  # a stale emission from a cached, already-tapped trace
        handler = HANDLERS.get(eqn.primitive.name)
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


def _bind(eqn, prim, invals, params):
    if eqn is None:
        out = _seam.bind_original(prim, invals, params)
        return list(out) if prim.multiple_results else [out]
    return _seam.bind_with_params(eqn, prim, invals, params)


def _one():
    return np.int32(1)


# ------------------------------------------------------------------ handlers
def handle_scan(walker, eqn, params, invals, scope, site):
    """A scan: observed through a driver and an effect-free runner.

    Evaluated (eagerly, under jit or vmap), an emitting scan becomes a
    *driver* while loop that emits each sampled carry around a *runner* that
    executes the user's steps exactly as ``scan`` lowers them, with no host
    callback inside (so XLA compiles the user's arithmetic as it would
    untapped). Differentiated, it is a scan with a step counter and the tap
    in its body (``custom_jvp`` picks that form), because only a scan has a
    reverse-mode rule.
    """
    body, nc, ncar, length = _seam.scan_parts(params)
    path, top = scope.address("scan", site)
    wants = walker.loop_wants("scan", path)
    emits = any(wants)
    if not emits and not walker.needs(body.jaxpr):
        return _bind(eqn, _seam.scan_p, invals, params)

    def stepped_body(counter, *args, diff=False):
        child = scope.child(path, Counter(), counter, length, top, diff=diff)
        return interpret(walker, body.jaxpr, body.consts, list(args), child)

    def in_body(*args):
        def fn(*a):
            consts, counter, rest = a[:nc], a[nc], a[nc + 1:]
            outs = stepped_body(counter, *consts, *rest, diff=True)
            if emits:
                # tie the step to the carry: a tap that ships only the step must
                # not look loop-invariant to autodiff's partial evaluation
                step = _seam.optimization_barrier((counter, *outs[:ncar]))[0] if ncar else counter
                walker.emit_loop(wants, path, top, length, step, outs[:ncar], outs[ncar:], batched_hop=False)
            return [lax.add(counter, _one())] + list(outs)

        avals = list(body.in_avals)
        new_body = _seam.trace_closed(fn, avals[:nc] + [_int32_aval()] + avals[nc:])
        new_params = _seam.scan_with_counter(params, new_body)
        outs = _bind(eqn, _seam.scan_p, list(args[:nc]) + [np.int32(0)] + list(args[nc:]), new_params)
        return outs[1:]

    if length == 0:
        return _bind(eqn, _seam.scan_p, invals, params)  # no step to observe
    if not emits:
        return in_body(*invals)
    if length == 1 and not walker.needs(body.jaxpr):
        # XLA inlines a one-trip loop: keep the scan as it is and observe its
        # outputs after it (the carry after step 0, and ys[0])
        outs = _bind(eqn, _seam.scan_p, invals, params)
        ys0 = [_seam.index_in_dim(y, np.int32(0)) for y in outs[ncar:]]
        walker.emit_loop(wants, path, top, length, np.int32(0), outs[:ncar], ys0, batched_hop=scope.diff is False)
        return outs
    stepped = _seam.trace_closed(stepped_body, [_int32_aval()] + list(body.in_avals))

    def driven(*args):
        return _scan_driver(walker, wants, params, stepped, path, top, args)

    return _seam.with_jvp_rule(driven, in_body, list(invals))


def _next_stop(i, k):
    """One past the next sampled step (steps 0, k, 2k, ... are sampled)."""
    return lax.add(lax.mul(lax.div(lax.add(i, lax.sub(k, _one())), k), k), _one())


def _drive(walker, wants, path, top, total, state, run_until, alive, observe, uniform):
    """The driver: run the effect-free runner up to each sampled step, emit.

    ``run_until(i, stop, state) -> (i2, state2)`` runs user steps
    ``i .. stop-1`` (fewer if the loop ends); ``alive(i, state)`` says whether
    the loop goes on; ``observe(last, state) -> (carry, ys)`` gives what a
    step's tap sees. ``uniform``: every runner call ends on a sampled step
    unless the loop ended (a scan), so sample_every=1 needs no gate. With
    ``flush_every=K``, K sampled steps are buffered on device and cross in
    one hop.
    """
    plan = walker.plan
    every, flush = plan.sample_every, plan.flush_every
    metas, payloads = walker.loop_parts(wants, path, top, total)
    n_state = len(state)

    def advance(i, k, st):
        i2, st2 = run_until(i, _next_stop(i, k), st)
        last = lax.sub(i2, _one())
        fired = lax.bitwise_and(lax.gt(i2, i), lax.eq(lax.rem(last, k), np.int32(0)))
        return i2, list(st2), last, fired

    # The sampling period enters as a runtime value so XLA cannot prove the
    # runner's trip count and fold it into the driver.
    k0 = _seam.optimization_barrier(np.int32(every))

    if flush is None and uniform:
        # A scan: the driver stops right after the last sampled step, so every
        # runner call ends on a sampled step and the hop needs no gate; the
        # steps after it run in one more runner call.
        n = np.int32(total)
        n_emit = np.int32(((total - 1) // every) * every + 1)

        def d_body(s):
            i, k, st = s[0], s[1], list(s[2:])
            i2, st2, last, _ = advance(i, k, st)
            carry, ys = observe(last, st2)
            emit(metas, lambda: payloads(carry, ys), walker.sinks.guard, step=last, sample_every=1)
            return (i2, k, *st2)

        out = _seam.while_loop(lambda s: lax.lt(s[0], n_emit), d_body, (np.int32(0), k0, *state))
        i, st = out[0], list(out[2:])
        if total - 1 > int(n_emit) - 1:
            _, st = run_until(i, n, st)
        return list(st)

    if flush is None:
        def d_body(s):
            i, k, st = s[0], s[1], list(s[3:])
            i2, st2, last, fired = advance(i, k, st)
            carry, ys = observe(last, st2)
            emit(metas, lambda: payloads(carry, ys), walker.sinks.guard, step=last, sample_every=every,
                 valid=fired)
            return (i2, k, alive(i2, st2), *st2)

        out = _seam.while_loop(lambda s: s[2], d_body, (np.int32(0), k0, alive(np.int32(0), state), *state))
        return list(out[3:])

    buf = Buffer(metas, payloads, observe, flush, walker.sinks.guard)
    if uniform:  # a scan: stop after the last sampled step (as above), no write gate
        n = np.int32(total)
        n_emit = np.int32(((total - 1) // every) * every + 1)
        alive = lambda i, st: lax.lt(i, n_emit)  # noqa: E731

    def d_body(s):
        i, k, live, st = s[0], s[1], s[2], list(s[3:3 + n_state])

        def c_body(cs):
            i, j, _, st, bufs = cs[0], cs[1], cs[2], list(cs[3:3 + n_state]), list(cs[3 + n_state:])
            i2, st2, last, fired = advance(i, k, st)
            j2, bufs2 = buf.write(None if uniform else fired, j, last, st2, bufs)
            return (i2, j2, alive(i2, st2), *st2, *bufs2)

        cs = _seam.while_loop(lambda cs: lax.bitwise_and(cs[2], lax.lt(cs[1], np.int32(flush))), c_body,
                              (i, np.int32(0), live, *st, *buf.empty()))
        i2, count, live2, st2, bufs = cs[0], cs[1], cs[2], list(cs[3:3 + n_state]), list(cs[3 + n_state:])
        buf.flush(count, bufs)
        return (i2, k, live2, *st2)

    buf.prepare(state)
    out = _seam.while_loop(lambda s: s[2], d_body, (np.int32(0), k0, alive(np.int32(0), state), *state))
    st = list(out[3:])
    if uniform and total - 1 > int(n_emit) - 1:
        _, st = run_until(out[0], n, st)
    return list(st)


def _scan_driver(walker, wants, params, stepped, path, top, args):
    body, nc, ncar, length = _seam.scan_parts(params)
    reverse = _seam.scan_reverse(params)
    consts, carry, xs = args[:nc], args[nc:nc + ncar], args[nc + ncar:]
    ys0 = [_seam.empty_stack(length, aval) for aval in body.out_avals[ncar:]]
    n = np.int32(length)

    def position(i):
        return lax.sub(lax.sub(n, i), _one()) if reverse else i

    def run_until(i, stop, st):
        def r_body(s):
            i, c, ys = s[0], s[2:2 + ncar], s[2 + ncar:]
            idx = position(i)
            x = [_seam.index_in_dim(v, idx) for v in xs]
            outs = _seam.call_closed(stepped, [i, *consts, *c, *x])
            ys = [_seam.update_index_in_dim(b, y, idx) for b, y in zip(ys, outs[ncar:])]
            return (lax.add(i, _one()), s[1], *outs[:ncar], *ys)

        out = _seam.while_loop(lambda s: lax.lt(s[0], s[1]), r_body, (i, lax.min(stop, n), *st))
        return out[0], out[2:]

    def observe(last, st):
        ys_now = [_seam.index_in_dim(b, position(last)) for b in st[ncar:]] if wants[1] else []
        return st[:ncar], ys_now

    if wants[1] and not ys0:
        wants = (wants[0], False)  # a body returning (carry, None) has no outputs
    state = [*carry, *ys0]
    return _drive(walker, wants, path, top, length, state, run_until, lambda i, st: lax.lt(i, n),
                  observe, uniform=True)


def handle_while(walker, eqn, params, invals, scope, site):
    """A while loop: observed through a driver and an effect-free runner.

    When this loop emits, it becomes two nested while loops: the *runner*
    executes the user's cond and body unchanged up to the next sampled step
    and holds no host callback (so XLA compiles the user's arithmetic as it
    would untapped - e.g. CPU's "small call" outlining still applies), and
    the *driver* around it emits the sampled carry.
    """
    cond, cnc, body, bnc = _seam.while_parts(params)
    path, top = scope.address("while", site)
    wants = walker.loop_wants("while", path)
    emits = any(wants)
    if not emits and not walker.needs(body.jaxpr):
        return _bind(eqn, _seam.while_p, invals, params)
    cconsts, bconsts, init = invals[:cnc], invals[cnc:cnc + bnc], invals[cnc + bnc:]

    def lane_pred(carry):
        return _seam.eval_jaxpr(cond.jaxpr, cond.consts, *cconsts, *carry)[0]

    # A while loop that vmap batched keeps a per-lane predicate: it runs while
    # any lane is alive and finished lanes keep their carry (as its lowering does).
    batched = bool(cond.out_avals[0].shape)

    def user_cond(carry):
        pred = lane_pred(carry)
        return _seam.any_lane(pred) if batched else pred

    def user_body(step, carry):
        child = scope.child(path, Counter(), step, None, top)
        outs = interpret(walker, body.jaxpr, body.consts, list(bconsts) + list(carry), child)
        if batched:
            pred = lane_pred(carry)
            outs = [_seam.select_lanes(pred, new, old) for new, old in zip(outs, carry)]
        return outs

    if not emits:
        # Nothing to emit here: only thread the step through for the inner taps.
        def plain_body(s):
            return (lax.add(s[0], _one()), *user_body(s[0], s[1:]))

        out = _seam.while_loop(lambda s: user_cond(s[1:]), plain_body, (np.int32(0), *init))
        return list(out[1:])

    def run_until(i, stop, carry):
        def r_cond(s):
            return lax.bitwise_and(user_cond(s[2:]), lax.lt(s[0], s[1]))

        def r_body(s):
            return (lax.add(s[0], _one()), s[1], *user_body(s[0], s[2:]))

        out = _seam.while_loop(r_cond, r_body, (i, stop, *carry))
        return out[0], list(out[2:])

    return _drive(walker, wants, path, top, None, list(init), run_until, lambda i, st: user_cond(st),
                  lambda last, st: (st, []), uniform=False)


def _child_scope_fn(scope, prefix, counter, threaded, top=None):
    def make(extra):
        step = extra[0] if threaded else None
        return scope.child(prefix, counter, step, scope.total, top or scope.top, in_loop=scope.in_loop)

    return make


def handle_jit(walker, eqn, params, invals, scope, site):
    body = _seam.jit_body(params)
    if scope.in_loop:
        (prefix, top), counter = scope.address("jit", site), Counter()
    else:
        prefix, top, counter = scope.prefix, scope.top, scope.counter
    threaded = scope.step is not None
    new_body = walker.rewrite_closed(
        body, _child_scope_fn(scope, prefix, counter, threaded, top), [_int32_aval()] if threaded else []
    )
    new_params = _seam.jit_with_body(params, new_body, extra_inputs=1 if threaded else 0)
    return _bind(eqn, _seam.jit_p, list(invals) + ([scope.step] if threaded else []), new_params)


def handle_cond(walker, eqn, params, invals, scope, site):
    threaded = scope.step is not None
    branches = [
        walker.rewrite_closed(
            br, _child_scope_fn(scope, scope.prefix, scope.counter, threaded),
            [_int32_aval()] if threaded else [],
        )
        for br in _seam.cond_branches(params)
    ]
    new_params = _seam.cond_with_branches(params, branches)
    return _bind(eqn, _seam.cond_p, list(invals) + ([scope.step] if threaded else []), new_params)


def handle_remat(walker, eqn, params, invals, scope, site):
    threaded = scope.step is not None
    closed = walker.rewrite_closed(
        _seam.remat_body(params), _child_scope_fn(scope, scope.prefix, scope.counter, threaded),
        [_int32_aval()] if threaded else [],
    )
    new_params, consts = _seam.remat_with_body(params, closed)
    args = list(consts) + list(invals) + ([scope.step] if threaded else [])
    return _bind(eqn, _seam.remat_p, args, new_params)


def _handle_call(prim):
    def handle(walker, eqn, params, invals, scope, site):
        # Custom-derivative bodies keep their signature (their rules are
        # untouched), so the step is not threaded in: see README boundaries.
        inner = scope.child(scope.prefix, scope.counter, None, scope.total, scope.top, in_loop=scope.in_loop)
        body = walker.rewrite_closed(_seam.call_body(params), lambda extra: inner)
        return _bind(eqn, prim, invals, _seam.call_with_body(params, body))

    return handle


HANDLERS = {
    _seam.SCAN: handle_scan,
    _seam.WHILE: handle_while,
    _seam.JIT: handle_jit,
    _seam.COND: handle_cond,
    _seam.REMAT: handle_remat,
    _seam.CUSTOM_JVP: _handle_call(_seam.custom_jvp_call_p),
    _seam.CUSTOM_VJP: _handle_call(_seam.custom_vjp_call_p),
    _seam.CLOSED_CALL: _handle_call(_seam.closed_call_p),
}


def rewrite_program(walker: Walker, closed):
    """Rewrite a whole traced program (the B-form's entry point)."""
    if not walker.needs(closed.jaxpr):
        return closed
    return walker.rewrite_closed(closed, lambda extra: walker.top_scope())
