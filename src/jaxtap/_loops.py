"""Loop handlers: scan and while, observed through a driver and a runner.

An emitting loop becomes a *driver* loop that emits (or buffers, with
``flush_every``) each sampled step around an effect-free *runner* that
executes the user's steps exactly as scan/while lower them, so XLA compiles
the user's arithmetic as it would untapped. Under differentiation the
derivatives are those of the user's own, untapped loop (``custom_jvp``), and
the tapped form runs on gradient-stopped inputs for the events alone.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from . import _seam
from ._cotangents import cotangent_view
from ._driver import Runner, drive
from ._side import Side
from ._host import warn_once_now
from ._rules import bind as _bind, bool_aval as _bool_aval, both as _both, int32_aval as _int32_aval, one as _one
from ._rules import events_only, observed, register, shadowed
from ._scope import Counter
from ._transform import interpret, tappable_names


@register(_seam.scan_p)
def handle_scan(walker, eqn, params, invals, scope, site):
    """A scan: observed through a driver and an effect-free runner.

    Evaluated (eagerly, under jit or vmap), an emitting scan becomes a
    *driver* while loop that emits each sampled carry around a *runner* that
    executes the user's steps exactly as ``scan`` lowers them, with no host
    callback inside (so XLA compiles the user's arithmetic as it would
    untapped). Differentiated, the derivatives are those of the user's own
    scan, and the driver runs on gradient-stopped inputs for the events.
    """
    scan = _ScanRewrite(walker, eqn, params, scope, site)
    if (scan.emits or walker.needs(scan.body.jaxpr)) and refs_untapped(_seam.scan_p, params, invals):
        return scan.plain(list(invals))
    # (a scan's ys come out of a buffer the runner fills: weakly typed as the
    # user's were, else JAX would promote the user's later arithmetic otherwise)
    return _seam.keep_weak_types(scan.body.out_avals, scan.strategy()(list(invals)))


def refs_untapped(prim, params, args) -> bool:
    """A loop that uses JAX Refs runs untapped, with one warning (the tapped
    form wraps the loop in calls JAX cannot discharge state through)."""
    if not _seam.holds_refs(prim, params, args):
        return False
    kind = "scan" if prim is _seam.scan_p else "while"
    warn_once_now(f"jax-tap: a {kind} loop that uses a JAX Ref (jax.new_ref, run_state) is not tapped; "
                  "it ran untapped.")
    return True


class _ScanRewrite:
    """One scan equation being rewritten: its parts, and the ways to emit it
    (:meth:`strategy` picks one)."""

    def __init__(self, walker, eqn, params, scope, site):
        self.walker, self.eqn, self.params, self.scope = walker, eqn, params, scope
        self.body, self.nc, self.ncar, self.length = _seam.scan_parts(params)
        # a backward scan (cotangent taps) reports at its forward twin's address
        info = _seam.backward_info(params) if walker.plan.backward else None
        self.view = None if info is None else cotangent_view(info)
        address = None if info is None else walker.backward_address(scope, info.forward_site, self.length)
        self.opaque = info is not None and address is None
        if self.opaque:
            # a nested backward loop whose forward twin cannot be told apart:
            # run as it is, never reported at another loop's address
            self.view, self.path, self.top, self.wants = None, scope.prefix, scope.top, (False, False)
        elif info is not None:
            self.path, self.top = address
            self.wants = (walker.loop_wants("scan", self.path, scope.provisional)[0], False)
        else:
            self.path, self.top = walker.loop_address(scope, _seam.loop_site(_seam.scan_p, params, site),
                                                      self.length)
            if walker.plan.backward:
                _seam.note_loop_as_written(params, site)  # (per lane under vmap: its backward twin's lanes)
            # a forward loop recomputed in a backward step (jax.checkpoint) is
            # not a second forward pass
            # (deeper in a backward step: a scan from the forward pass's site and
            # carry recomputes it; another, a custom_vjp's own bwd loop, is reported)
            recomputed = scope.backward or (scope.recomputing and _seam.written_before(params, site))
            self.wants = (False, False) if recomputed else walker.loop_wants("scan", self.path,
                                                                                 scope.provisional)
        self.emits = any(self.wants)
        plan = walker.plan
        # an inner scan no longer than K may ride in its enclosing buffered step
        self.as_block = (scope.side is not None and walker.buffers and plan.sample_every == 1
                         and self.length <= plan.flush_every)
        self.rows = scope.side.rows * self.length if self.as_block else (plan.flush_every or 1)
        self.sides = walker.sides_for(self.body.jaxpr)  # (see Walker.sides_for)
        # inside a vmapped while body (or a branch of a batched cond), events of
        # lanes that are not running are dropped: the flag enters every trace
        self.lane_running = scope.lane_running
        self.lane_flags = [] if self.lane_running is None else [self.lane_running]
        self.stepped, self.side = None, None  # the traced step and its buffered taps (_trace_step)
        self._quiet = False

    def strategy(self):
        """The rewrite for this scan: a function of its inputs."""
        needs = self.walker.needs(self.body.jaxpr)
        if (not self.emits and not needs) or self.length == 0 or self.opaque:
            return self.plain  # nothing to observe here or inside (or no step at all)
        if self.as_block:
            self._trace_step()
            if self.emits or self.side is not None:
                return self.block
        if not self.emits and not self.sides:
            return self.thread
        if self.length == 1 and not needs and self.view is None:
            return self.one_trip
        self._trace_step()
        if not self.emits and self.side is None:
            return self.thread  # no buffered tap in this body after all
        return self.driven

    # ------------------------------------------------------------- the step
    def _step(self, counter, *args, buffered=True):
        # JAX never differentiates what runs here (see _seam.observed), so
        # taps may use the vmap-aware hop (differentiable=False)
        args, lane_running = (args[:-1], args[-1]) if self.lane_flags else (args, None)
        side = Side(self.rows) if self.sides and buffered else None
        child = self.scope.child(self.path, Counter(), counter, self.length, self.top, differentiable=False, side=side,
                                 backward=self.view is not None)
        if self.view is not None:  # primitive taps sample forward steps too
            child.sample_offset = (self.length - 1) % self.walker.plan.sample_every
        child.lane_running = lane_running
        outs = interpret(self.walker, self.body.jaxpr, self.body.consts, list(args), child)
        if side is None:
            return outs
        self._sides = [side]
        return list(outs) + side.values  # buffered primitive-tap values ride out

    def _trace_step(self):
        # an events-only run leaves the user's debug callbacks out (_rules.observed)
        quiet = events_only() and not _seam.DEBUG_EFFECTS.isdisjoint(tappable_names(self.body.jaxpr))
        if self.stepped is None or quiet != self._quiet:
            self._quiet = quiet
            self._sides = []
            self.stepped = _seam.trace_closed(self._step, [_int32_aval()] + list(self.body.in_avals)
                                              + [_bool_aval()] * len(self.lane_flags))
            self.side = self._sides[0] if self._sides and self._sides[0].entries else None

    # ------------------------------------------------------------ strategies
    def plain(self, invals):
        return _bind(self.eqn, _seam.scan_p, list(invals), self.params)

    def _plain(self, *args):
        return self.plain(args)

    def thread(self, invals):
        """A scan that does not emit itself: its step counter rides in the
        carry for the taps inside it."""
        return self._observe(self._counted, invals)

    def _observe(self, run, invals):
        why = shadows(self.walker, self.body.jaxpr, self.length) if self.view is None else None
        if why:
            # (a short scan's copy is not unrolled as the program's run is: its last bits may differ)
            return shadowed(run, self._plain, invals, check=why == "taps")
        return observed(run, self._plain, invals)

    def _counted(self, *args):
        nc, ng = self.nc, len(self.lane_flags)

        def fn(*a):
            consts, flags, counter, rest = a[:nc], a[nc:nc + ng], a[nc + ng], a[nc + ng + 1:]
            outs = self._step(counter, *consts, *rest, *flags, buffered=False)
            return [lax.add(counter, _one())] + list(outs)

        avals = list(self.body.in_avals)
        new_body = _seam.trace_closed(fn, avals[:nc] + [_bool_aval()] * ng + [_int32_aval()] + avals[nc:])
        new_params = _seam.scan_with_counter(self.params, new_body, extra_consts=ng)
        outs = _bind(self.eqn, _seam.scan_p, list(args[:nc]) + self.lane_flags + [np.int32(0)] + list(args[nc:]),
                     new_params)
        return outs[1:]

    def block(self, invals):
        """Inside a buffered step: this whole scan becomes one Block of that
        step, collected by a callback-free driver (never differentiated),
        unless the block would make the device buffer too large."""
        return _scan_driver(self.walker, self.wants, self.params, self.stepped, self.path, self.top, invals,
                            self.side, self.lane_running, collect=self.scope.side, view=self.view)

    def one_trip(self, invals):
        """XLA inlines a one-trip loop: keep the scan as it is and observe its
        outputs after it (the carry after step 0, and ys[0])."""
        outs = self.plain(invals)
        ys0 = [_seam.index_in_dim(y, np.int32(0)) for y in outs[self.ncar:]]
        carry, ys0 = _user_view(_seam.forwarding_of(_seam.scan_p, self.params) if self.view is None else None,
                                outs[:self.ncar], ys0, invals[:self.nc], invals[self.nc + self.ncar:], np.int32(0))
        self.walker.emit_loop(self.wants, self.path, self.top, self.length, np.int32(0), carry, ys0,
                              when=self.lane_running, batched_hop=self.scope.differentiable is False)
        return outs

    def driven(self, invals):
        def run(*args):
            self._trace_step()
            return _scan_driver(self.walker, self.wants, self.params, self.stepped, self.path, self.top, args,
                                self.side, self.lane_running, view=self.view)

        return self._observe(run, invals)


# A scan of at most this many steps whose body holds no loop runs as written,
# its tapped form a copy for the events (_rules.shadowed): XLA unrolls a short
# loop whose trip count it knows, and rounds the unrolled steps otherwise than
# a runner's (JAX 0.12.1 on CPU contracts some multiply-adds there).
_SHORT_SCAN = 32


def shadows(walker, jaxpr, length=None):
    """Does this loop run as written, its tapped form a copy for events?
    ``"taps"`` where its body (at any depth) holds primitive taps, ``"short"``
    for a short scan with no loop inside (``length``: a scan's), else None.
    Never inside a copy, nor where the body has callbacks of the user's (XLA
    compiles such a loop as a tapped one already, and they must see its
    events live)."""
    if events_only() or jaxpr.effects:
        return None
    names = tappable_names(jaxpr)
    if walker.taps_any(names):
        return "taps"
    short = length is not None and length <= _SHORT_SCAN and _seam.SCAN not in names and _seam.WHILE not in names
    return "short" if short else None


def _user_view(fwd, carry, ys, consts, xs, idx):
    """The carry leaves (and scan outputs) as the user's body returns them:
    those JAX's loop front end moved out put back (``fwd``, see
    ``_seam.forwarding``). ``ys`` None: not wanted."""
    if fwd is None:
        return list(carry), ys
    carry = _seam.merge_forwarded(fwd, carry, consts[:fwd.moved])
    if ys is not None and fwd.ys:
        kept = iter(ys)
        ys = [next(kept) if f is None else _seam.index_in_dim(xs[f], idx) for f in fwd.ys]
    return carry, ys


def _scan_driver(walker, wants, params, stepped, path, top, args, side, lane_running=None, collect=None, view=None):
    body, nc, ncar, length = _seam.scan_parts(params)
    reverse = _seam.scan_reverse(params)
    consts, carry, xs = args[:nc], args[nc:nc + ncar], args[nc + ncar:]
    ys0 = [_seam.empty_stack(length, aval) for aval in body.out_avals[ncar:]]
    nys = len(ys0)
    side0 = [_seam.empty_like(aval) for aval in stepped.out_avals[ncar + nys:]]
    n = np.int32(length)

    def position(i):
        return lax.sub(lax.sub(n, i), _one()) if reverse else i

    def run_until(i, stop, st):
        def r_body(s):
            i, c, ys = s[0], s[2:2 + ncar], s[2 + ncar:2 + ncar + nys]
            idx = position(i)
            x = [_seam.index_in_dim(v, idx) for v in xs]
            outs = _seam.call_closed(stepped, [i, *consts, *c, *x] + ([] if lane_running is None else [lane_running]))
            ys = [_seam.update_index_in_dim(b, y, idx) for b, y in zip(ys, outs[ncar:ncar + nys])]
            return (lax.add(i, _one()), s[1], *outs[:ncar], *ys, *outs[ncar + nys:])

        out = _seam.while_loop(lambda s: lax.lt(s[0], s[1]), r_body, (i, lax.min(stop, n), *st))
        return out[0], out[2:]

    fwd = _seam.forwarding_of(_seam.scan_p, params) if view is None else None

    def observe(last, st):
        ys_now = [_seam.index_in_dim(b, position(last)) for b in st[ncar:ncar + nys]] if wants[1] else []
        carry, ys_now = _user_view(fwd, st[:ncar], ys_now if wants[1] else None, consts, xs, position(last))
        return carry, ys_now or [], st[ncar + nys:]

    if wants[1] and not ys0 and not (fwd is not None and fwd.ys):
        wants = (wants[0], False)  # a body returning (carry, None) has no outputs
    state = [*carry, *ys0, *side0]
    offset = (length - 1) % walker.plan.sample_every if view is not None else 0
    runner = Runner(state, run_until, lambda i, st, loud=False: lax.lt(i, n), observe, length, uniform=True,
                    offset=offset)
    out = drive(walker, wants, path, top, runner, side=side, collect=collect, lane_running=lane_running, view=view)
    return out[:ncar + nys]


@register(_seam.while_p)
def handle_while(walker, eqn, params, invals, scope, site):
    """A while loop: observed through a driver and an effect-free runner.

    When this loop emits, it becomes two nested while loops: the *runner*
    executes the user's cond and body unchanged up to the next sampled step
    and holds no host callback (so XLA compiles the user's arithmetic as it
    would untapped - e.g. CPU's "small call" outlining still applies), and
    the *driver* around it emits the sampled carry. Differentiated (forward
    mode), the derivatives are those of the user's own loop.
    """
    cond, cnc, body, bnc = _seam.while_parts(params)
    path, top = scope.address("while", _seam.loop_site(_seam.while_p, params, site))
    wants = walker.loop_wants("while", path, scope.provisional)
    emits = any(wants)
    # (an events-only run threads even a loop it leaves alone whose cond prints: it prints in the user's run)
    quiet_cond = events_only() and _seam.has_debug_effects(cond.jaxpr)
    if (not emits and not walker.needs(body.jaxpr) and not quiet_cond) or refs_untapped(_seam.while_p, params, invals):
        return _bind(eqn, _seam.while_p, invals, params)

    def plain(*args):
        return _bind(eqn, _seam.while_p, list(args), params)

    fwd = _seam.forwarding_of(_seam.while_p, params)

    def tapped(*args):
        return _tapped_while(walker, scope, path, top, wants, emits, cond, cnc, body, bnc, list(args), fwd)

    shadow = shadows(walker, body.jaxpr) is not None and not cond.jaxpr.effects
    return (shadowed if shadow else observed)(tapped, plain, list(invals))


def _tapped_while(walker, scope, path, top, wants, emits, cond, cnc, body, bnc, invals, fwd=None):
    loop = _WhileRewrite(walker, scope, path, top, cond, cnc, body, bnc, invals, fwd)
    if not emits and loop.side is None:
        return loop.thread()  # nothing to emit here: only thread the step through for the inner taps
    out = drive(walker, wants, path, top, loop.runner(), side=loop.side, lane_running=loop.lane_running)
    return out[:len(loop.init)]


class _WhileRewrite:
    """One while loop being rewritten: its cond and body as the runner and
    the inner taps need them."""

    def __init__(self, walker, scope, path, top, cond, cnc, body, bnc, invals, fwd=None):
        self.walker, self.scope, self.path, self.top = walker, scope, path, top
        self.cond, self.body = cond, body
        self.cconsts, self.bconsts, self.init = invals[:cnc], invals[cnc:cnc + bnc], invals[cnc + bnc:]
        # A while loop that vmap batched keeps a per-lane predicate: it runs while
        # any lane is running and finished lanes keep their carry (as its lowering does).
        self.batched = bool(cond.out_avals[0].shape)
        self.noisy = _seam.has_debug_effects(cond.jaxpr)  # the user's debug effects in cond_fun: see lane_pred
        self.lane_running = scope.lane_running  # an enclosing lane flag (see handle_scan)
        self.lane_flags = [] if self.lane_running is None else [self.lane_running]
        self.stepped, self.side = None, None
        self.fwd = fwd  # carry leaves the front end moved out (see _seam.forwarding)
        self.sides = walker.sides_for(body.jaxpr)
        if self.sides and walker.needs(body.jaxpr):
            self._trace_step()

    def lane_pred(self, carry, cc=None, loud=False):
        """The user's cond on ``carry``. Its debug effects (a ``jax.debug.print``
        in ``cond_fun``) fire only where ``loud`` (a bool or a traced one):
        the runner and the driver evaluate the cond more often than the
        untapped loop, which does once before each step and once at its end."""
        args = (*(self.cconsts if cc is None else cc), *carry)
        if not self.noisy or loud is True and not events_only():
            return _seam.eval_jaxpr(self.cond.jaxpr, self.cond.consts, *args)[0]

        def quiet(*a):
            return _seam.eval_jaxpr_quiet(self.cond.jaxpr, self.cond.consts, *a)[0]
        if loud is False or events_only():
            return quiet(*args)
        return lax.cond(loud, lambda *a: _seam.eval_jaxpr(self.cond.jaxpr, self.cond.consts, *a)[0], quiet, *args)

    def user_cond(self, carry, loud=False):
        pred = self.lane_pred(carry, loud=loud)
        return _seam.any_lane(pred) if self.batched else pred

    def user_body(self, step, carry, bc=None, cc=None, buffered=False, outer=None):
        bc = self.bconsts if bc is None else bc
        side = Side(self.walker.plan.flush_every or 1) if buffered else None
        # a while body is never transposed: its taps may use the vmap-aware hop
        child = self.scope.child(self.path, Counter(), step, None, self.top, differentiable=False, side=side)
        # (a while that vmap already batched runs every lane as one value: no lane_running)
        # (read only by taps inside the body: without any, cond_fun is not run again)
        reads = not self.batched and self.walker.needs(self.body.jaxpr)
        child.lane_running = _both(self.lane_pred(carry, cc) if reads else None, outer)
        outs = interpret(self.walker, self.body.jaxpr, self.body.consts, list(bc) + list(carry), child)
        if self.batched:
            pred = self.lane_pred(carry, cc)
            outs = [_seam.select_lanes(pred, new, old) for new, old in zip(outs, carry)]
        if side is not None:
            self._sides = [side]
            outs = list(outs) + side.values  # buffered primitive-tap values ride out
        return outs

    def _trace_step(self):
        # the consts enter as arguments: a traced step must not close over tracers
        nb, nk, ng = len(self.bconsts), len(self.cconsts), len(self.lane_flags)
        self._sides = []
        self.stepped = _seam.trace_closed(
            lambda step, *a: self.user_body(step, a[nb + nk + ng:], a[:nb], a[nb:nb + nk], buffered=True,
                                            outer=a[nb + nk] if ng else None),
            [_int32_aval()] + [_seam.abstractify(x) for x in [*self.bconsts, *self.cconsts, *self.lane_flags,
                                                               *self.init]])
        if self._sides[0].entries:
            self.side = self._sides[0]
        else:
            self.stepped = None  # no buffered tap in this body after all

    def thread(self):
        def body(s):
            return (lax.add(s[0], _one()), *self.user_body(s[0], s[1:], outer=self.lane_running))

        out = _seam.while_loop(lambda s: self.user_cond(s[1:], loud=True), body, (np.int32(0), *self.init))
        return list(out[1:])

    def step(self, step, carry):
        if self.stepped is None:
            return self.user_body(step, carry, outer=self.lane_running)
        return _seam.call_closed(self.stepped, [step, *self.bconsts, *self.cconsts, *self.lane_flags, *carry])

    def runner(self) -> Runner:
        ncarry = len(self.init)

        def run_until(i, stop, state):
            def r_cond(s):  # i < stop, modulo 2**32 (see _driver._next_stop)
                # (the cond's debug effects fire here past the runner's first step: the driver
                # asked the cond of the state it starts from; see Runner)
                running = self.user_cond(s[2:2 + ncarry], loud=lax.ne(s[0], i))
                return lax.bitwise_and(running, lax.lt(lax.sub(s[0], s[1]), np.int32(0)))

            def r_body(s):
                return (lax.add(s[0], _one()), s[1], *self.step(s[0], s[2:2 + ncarry]))

            out = _seam.while_loop(r_cond, r_body, (i, stop, *state))
            return out[0], list(out[2:])

        side0 = [] if self.stepped is None else [_seam.empty_like(a) for a in self.stepped.out_avals[ncarry:]]

        def observe(last, st):
            return _user_view(self.fwd, st[:ncarry], None, self.bconsts, (), last)[0], [], st[ncarry:]

        return Runner(list(self.init) + side0, run_until, lambda i, st, loud=False: self.user_cond(st[:ncarry], loud),
                      observe, None, uniform=False)
