"""The driver: the loop that emits around a tapped loop's effect-free runner.

A tapped loop is a *runner* (the user's steps, exactly as scan/while lower
them, no callback: see :class:`Runner`) inside a *driver* that runs it up to
each sampled step and emits there, one hop per sampled step or, with
``flush_every=K``, K sampled steps written to a device buffer and shipped in
one hop. :func:`drive` picks the driver; ``_loops`` builds the runners.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np
from jax import lax

from . import _seam
from ._emit import Block, Buffer, emit
from ._rules import both as _both, one as _one


def _next_stop(i, k, offset=0, wraps=False):
    """One past the next sampled step at or after ``i`` (steps offset,
    offset+k, ... are sampled; 0 <= offset < k).

    ``wraps`` (a while loop, which may run past 2**31-1 steps): the stop is
    ``i`` plus a distance in 1..k, so it wraps with ``i`` (the runner
    compares ``i - stop``) instead of overflowing on its own. A scan's
    steps fit int32 and keep the plain formula (the same value: other ops
    would move XLA's schedule, which alone orders a scan's forward events
    before its backward ones, see ``tests/test_backward.py``).
    """
    if not wraps:
        if offset:
            i = lax.sub(i, np.int32(offset))
        stop = lax.add(lax.mul(lax.div(lax.add(i, lax.sub(k, _one())), k), k), _one())
        return lax.add(stop, np.int32(offset)) if offset else stop
    gap = lax.rem(lax.sub(np.int32(offset), i), k)  # in (-k, k)
    gap = lax.select(lax.lt(gap, np.int32(0)), lax.add(gap, k), gap)
    return lax.add(i, lax.add(gap, _one()))


def _ran(ran, i):
    """Did the runner run a step (``ran`` past ``i``, modulo 2**32)?"""
    return lax.gt(lax.sub(ran, i), np.int32(0))


# The step a while loop's driver counts from: 0 (tests start it just below
# 2**31 to cross the int32 wrap in a few steps)
_FIRST_STEP = np.int32(0)


class Runner(NamedTuple):
    """The effect-free half of a tapped loop, as the driver sees it.

    ``run_until(i, stop, state) -> (i2, state2)`` runs user steps
    ``i .. stop-1`` (fewer if the loop ends); ``goes_on(i, state, loud=False)``
    says whether the loop goes on (a while loop's: the debug effects of the
    user's cond fire only where ``loud``, as the driver's first call asks:
    the runner fires them for every later state it reaches, so that the
    cond's prints come once per state, as untapped);
    ``observe(last, state) -> (carry, ys, side values)`` is what a step's
    tap sees. ``total``: a scan's length (None for a while
    loop); ``uniform``: every runner call ends on a sampled step unless the
    loop ended (a scan), so ``sample_every=1`` needs no lane_running.
    """

    state: list
    run_until: Callable
    goes_on: Callable
    observe: Callable
    total: Optional[int]
    uniform: bool
    # a backward scan samples the steps whose *forward* step total-1-i is a
    # multiple of sample_every: i = offset, offset + k, ...
    offset: int = 0
    # the plan's sample_every (static; ``k`` holds the same value at run time);
    # 0: the counter is read out of the runner, as before jax-tap 0.9.1
    every: int = 0

    @property
    def one_step(self) -> bool:
        """Sampled every step (from step 0): each driver call runs one step."""
        return self.every == 1 and not self.offset

    def advance(self, i, k, state):
        """Run to the next sampled step: (i2, state2, last step run, sampled?).

        ``sampled`` is None where it is statically true (a scan sampling
        every step).

        The driver's next ``i2`` is computed, not read out of the runner:
        followed through the runner, XLA's loop analyses evaluate the user's
        body at every simplification pass (3-4 x slower HLO passes on a NUTS
        kernel). Two exceptions read it out: a while loop sampled every
        k > 1 steps (it may end before its next sampled step), and
        ``every == 0`` (cotangent taps, see ``_drive``). ``last`` always
        comes out of the runner: a hop that carries it runs after the taps
        inside it.
        """
        one_step = self.one_step
        # every == 1: the driver calls only while the loop goes on, so the
        # runner runs exactly step i; k stays a run-time 1, so the runner's
        # trip count is not provable (XLA would inline it into the driver)
        stop = lax.add(i, k) if one_step else _next_stop(i, k, self.offset, wraps=self.total is None)
        ran, st2 = self.run_until(i, stop, state)
        last = lax.sub(ran, _one())
        if one_step:
            # a while loop batched by a vmap applied later runs its driver
            # while any lane goes on: a finished lane's runner runs no step
            # and that lane emits nothing (its i2 is discarded by the batching)
            return stop, list(st2), last, (None if self.uniform else _ran(ran, i))
        since = lax.sub(last, np.int32(self.offset)) if self.offset else last
        sampled = lax.bitwise_and(_ran(ran, i), lax.eq(lax.rem(since, k), np.int32(0)))
        # a scan's runner reaches min(stop, total); every == 0: read it out of the runner
        i2 = ran if self.total is None or not self.every else lax.min(stop, np.int32(self.total))
        return i2, list(st2), last, sampled

    def last_sampled(self, every):
        """One past a scan's last sampled step: the driver stops there."""
        return np.int32(((self.total - 1 - self.offset) // every) * every + self.offset + 1)

    def finish(self, i, state, every):
        """A scan's steps after its last sampled one, in one more runner call."""
        if self.total - 1 > int(self.last_sampled(every)) - 1:
            _, state = self.run_until(i, np.int32(self.total), state)
        return list(state)


class _Hop(NamedTuple):
    """State of a driver that emits every sampled step (a scan drops ``goes_on``)."""

    i: Any
    k: Any
    goes_on: Any
    state: list


class _Fill(NamedTuple):
    """State of the loop that fills one buffer between two flushes."""

    i: Any
    row: Any
    goes_on: Any
    state: list
    buffers: list


def drive(walker, wants, path, top, runner: Runner, side=None, collect=None, lane_running=None, view=None):
    """The driver: run the effect-free runner up to each sampled step, emit.

    With ``flush_every=K``, K sampled steps are buffered on device and cross
    in one hop; ``side`` holds the buffered primitive taps of the body, whose
    latest values the runner carries. ``collect`` (a scan inside a buffered
    step, sample_every=1): every step is written to one buffer of the scan's
    length, with no callback, and the buffer joins ``collect`` (the
    enclosing step's Side) as a Block. ``lane_running``: a lane flag; where it is
    false (a finished lane of an enclosing vmapped while loop) nothing is
    emitted. ``view``: a backward loop's carry as its select sees it.
    Returns the runner's final state.
    """
    metas, loop_payloads = walker.loop_parts(wants, path, top, runner.total, view)
    fired = None  # (seen) -> traced "a tripwire fired", where only tripwires ride
    if side is None:
        def payloads(carry, ys, side_values):
            return loop_payloads(carry, ys)
    else:  # a step's primitive events come before its carry, as unbuffered
        if not metas and side.gated_only:
            def fired(seen):
                return side.any_fired(seen[2])
        metas = side.metas + metas

        def payloads(carry, ys, side_values):
            return side.payloads(side_values) + loop_payloads(carry, ys)

    # The sampling period enters as a runtime value so XLA cannot prove the
    # runner's trip count and fold it into the driver.
    k0 = _seam.optimization_barrier(np.int32(walker.plan.sample_every))
    # (with cotangent taps the driver keeps reading its counter out of the
    # runner: XLA then schedules the events-only forward run before the
    # backward pass, which nothing else orders; see Runner.advance)
    runner = runner._replace(every=0 if walker.plan.backward else walker.plan.sample_every)
    if walker.plan.flush_every is None:
        drive = _drive_scan if runner.uniform else _drive_while
        return drive(walker, metas, payloads, runner, k0, lane_running, fired)
    if collect is not None:
        out = _collect(metas, payloads, runner, k0, walker.sinks.guard, collect)
        if out is not None:
            return out
    return _drive_buffered(walker, metas, payloads, runner, k0, lane_running, nested="/" in path)


def _goes_on(s):
    """A driver's cond: its carried flag, and'ed with a test that never fails
    (the sampling period, a run-time value XLA cannot see, is not 0).

    A cond that is a bare carried flag lets XLA's trip-count analysis take the
    flag for an induction variable and evaluate it by brute force, cloning
    the runner (the user's nested loops) at every round of its
    simplification pipeline: about 0.5 s more compile on a BlackJAX NUTS
    program. A cond of two different terms has no induction variable.
    The flag itself stays carried (computed in the body: see README,
    "nested emitting loops on CPU", for why that matters to rounding).
    """
    return lax.bitwise_and(s[2], lax.ne(s[1], np.int32(0)))


def _drive_scan(walker, metas, payloads, runner, k0, lane_running, fired=None):
    """A scan, one hop per sampled step: the driver stops right after the last
    sampled step, so every runner call ends on a sampled step and the hop
    needs no lane_running; the steps after it run in one more runner call.
    ``fired(seen)``: where only tripwires ride, the hop runs where one fired."""
    every = walker.plan.sample_every

    def d_body(s):
        i, k, st = s[0], s[1], list(s[2:])
        i2, st2, last, _ = runner.advance(i, k, st)
        seen = runner.observe(last, st2)
        when = lane_running if fired is None else _both(fired(seen), lane_running)
        emit(metas, lambda: payloads(*seen), walker.sinks.guard, step=last, sample_every=1, when=when)
        return (i2, k, *st2)

    stop = runner.last_sampled(every)
    out = _seam.while_loop(lambda s: lax.lt(s[0], stop), d_body, (np.int32(0), k0, *runner.state))
    return runner.finish(out[0], list(out[2:]), every)


def _drive_while(walker, metas, payloads, runner, k0, lane_running, fired=None):
    """A while loop, one hop per sampled step, gated by "sampled" (and by
    ``fired(seen)``, where only tripwires ride)."""
    n_state = len(runner.state)
    one_step = runner.one_step  # then "sampled" means the step ran (false only in finished lanes)

    def d_body(flat):
        s = _Hop(flat[0], flat[1], flat[2], list(flat[3:3 + n_state]))
        i2, st2, last, sampled = runner.advance(s.i, s.k, s.state)
        seen = runner.observe(last, st2)
        when = _both(sampled, lane_running)
        emit(metas, lambda: payloads(*seen), walker.sinks.guard, step=last, sample_every=walker.plan.sample_every,
             when=when if fired is None else _both(fired(seen), when), gate_on_host=one_step and fired is None)
        return (i2, s.k, runner.goes_on(i2, st2), *st2)

    start = _FIRST_STEP
    out = _seam.while_loop(_goes_on, d_body, (start, k0, runner.goes_on(start, runner.state, True), *runner.state))
    return list(out[3:])


def _drive_buffered(walker, metas, payloads, runner, k0, lane_running, nested=False):
    """Buffered: K sampled steps written on device, one hop per flush."""
    every, flush = walker.plan.sample_every, walker.plan.flush_every
    if runner.uniform:
        flush = min(flush, runner.total)  # a scan never needs more rows than steps
    elif nested:
        # a while loop inside another loop flushes at its own end and starts
        # a fresh (zeroed) buffer on every run: K rows each time would cost
        # more than the hops they save when its runs are short
        flush = min(flush, _NESTED_WHILE_ROWS)
    buf = Buffer(metas, payloads, runner.observe, flush, walker.sinks.guard)
    goes_on = runner.goes_on
    if runner.uniform:  # a scan: stop after the last sampled step (as unbuffered), no write lane_running
        stop = runner.last_sampled(every)
        goes_on = lambda i, st, loud=False: lax.lt(i, stop)  # noqa: E731
    n_state = len(runner.state)

    def d_body(flat):
        s = _Hop(flat[0], flat[1], flat[2], list(flat[3:3 + n_state]))

        def c_body(cflat):
            c = _Fill(cflat[0], cflat[1], cflat[2], list(cflat[3:3 + n_state]), list(cflat[3 + n_state:]))
            i2, st2, last, sampled = runner.advance(c.i, s.k, c.state)
            row, bufs = buf.write(_both(None if runner.uniform else sampled, lane_running), c.row, last, st2, c.buffers)
            return (i2, row, goes_on(i2, st2), *st2, *bufs)

        cflat = _seam.while_loop(lambda c: lax.bitwise_and(c[2], lax.lt(c[1], np.int32(flush))), c_body,
                                 (s.i, np.int32(0), s.goes_on, *s.state, *buf.empty()))
        c = _Fill(cflat[0], cflat[1], cflat[2], list(cflat[3:3 + n_state]), list(cflat[3 + n_state:]))
        buf.flush(c.row, c.buffers)
        return (c.i, s.k, c.goes_on, *c.state)

    buf.prepare(runner.state, lambda st: runner.advance(np.int32(0), k0, st)[1])
    # a buffer bigger than _BUFFER_BYTES flushes sooner than asked (a while
    # loop's length is unknown, and K=10**9 must not allocate 10**9 rows)
    flush = buf.capacity = max(1, min(flush, _BUFFER_BYTES // max(1, buf.row_bytes())))
    start = _FIRST_STEP
    out = _seam.while_loop(_goes_on, d_body, (start, k0, goes_on(start, runner.state, True), *runner.state))
    st = list(out[3:])
    return runner.finish(out[0], st, every) if runner.uniform else st


_NESTED_WHILE_ROWS = 64  # rows of a buffered while loop nested in another loop
_BLOCK_BYTES = 4 << 20  # the most device memory blocks may add to a buffer
_BUFFER_BYTES = 4 << 20  # the most device memory one loop's buffer may take (a flush ships it whole)


def _collect(metas, payloads, runner, k, guard, into):
    """A scan inside a buffered step: every step into one buffer of the
    scan's length, no callback; the buffer joins ``into`` as a Block (None
    when the block would make the device buffer too large)."""
    total, state = runner.total, runner.state
    buf = Buffer(metas, payloads, runner.observe, total, guard)
    buf.prepare(state, lambda st: runner.run_until(np.int32(0), k, st)[1])
    if into.rows * total * buf.row_bytes() > _BLOCK_BYTES:
        return None
    n, n_state = np.int32(total), len(state)

    def c_body(cs):
        i, j, st, bufs = cs[0], cs[1], list(cs[2:2 + n_state]), list(cs[2 + n_state:])
        i2, st2 = runner.run_until(i, lax.add(i, k), st)
        j2, bufs2 = buf.write(None, j, i, list(st2), bufs)
        return (i2, j2, *st2, *bufs2)

    start = (np.int32(0), np.int32(0), *state, *buf.empty(spare=False))
    cs = _seam.while_loop(lambda cs: lax.lt(cs[0], n), c_body, start)
    into.add(Block(metas, buf.layouts, total), list(cs[3 + n_state:]))  # rows in execution order; steps implied
    return list(cs[2:2 + n_state])
