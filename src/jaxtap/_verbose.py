"""The wrapping form: ``tap.verbose(f)``.

Each call of the wrapper opens a call scope (``_lens.CallScope``) and calls
``f`` as written inside it: eagerly when called eagerly, or into whatever
trace (jit, vmap, grad) the caller is under. The loops ``f`` executes are
intercepted and rewritten exactly as a ``with tap.record()`` block's are, so
``f`` keeps its eager semantics (Python branches, inline jits) and both
forms give the same addresses and events by construction.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional, Sequence, Union

from . import _seam
from ._collectors import FlightRecorder
from ._host import Consumers, warn_once_now
from ._lens import CallScope, Token, interception_unavailable
from ._options import Config, PrimTap, build_plan
from ._timetaps import make_time_taps
from ._toolkit import prim_consumers, warn_unmatched


class Tapped:
    """A function observed by jax-tap; call it exactly like the original."""

    def __init__(self, f: Callable, plan, consumers: Consumers, prims, times=None):
        # the wrapped callable's own attributes show through, except where
        # they would shadow our methods (Equinox's filter_jit has a
        # `_signature`); our instance attributes are assigned after the copy
        functools.update_wrapper(self, f, updated=())
        methods = set(dir(type(self)))
        for key, value in getattr(f, "__dict__", {}).items():
            if key not in methods and key not in self.__dict__:
                self.__dict__[key] = value
        self.__wrapped__ = f
        self._plan = plan
        self._token = Token(None, plan, owner=self)
        self._consumers = consumers
        self._prims = prims
        self._times = times
        self._observes = plan.active or times is not None
        # this wrapper's top-level addresses: the walker's own, so a device-side
        # `where` and the delivered path always agree (see _routing.Router)
        self._sites = self._token.walker.sites
        self._names_seen: set = set()
        self._warned_names = False

    def __get__(self, obj, objtype=None):
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args, **kwargs):
        f = self.__wrapped__
        if not self._observes:
            return f(*args, **kwargs)
        if _seam.jit_disabled():
            _warn_disabled()
            return f(*args, **kwargs)  # op by op, as f would run: nothing to tap
        if interception_unavailable("f"):
            return f(*args, **kwargs)
        if _seam.BUSY.depth:
            # called by a consumer (or inside jax-tap's own tracing): its JAX
            # work is never tapped, and under our token its untapped trace
            # would be cached as the wrapper's
            return f(*args, **kwargs)
        self._consumers.new_run()
        for p in self._prims:
            p.new_run()
        with CallScope(self._token, self._sites, self._names_seen, _seam.barrier_here(), self._times):
            out = f(*args, **kwargs)
        if inspect.isgenerator(out):
            return self._iterate(out)  # its loops run as it is iterated
        plan = self._plan
        if plan.prim_taps and self._names_seen and not self._warned_names:
            self._warned_names = True
            warn_unmatched(plan.prim_taps, self._names_seen)
        return out

    def _iterate(self, gen):
        """A generator ``f`` returned: each of its steps runs inside a scope."""
        value = None
        while True:
            with CallScope(self._token, self._sites, self._names_seen, _seam.barrier_here(), self._times):
                try:
                    item = gen.send(value)
                except StopIteration as stop:
                    return stop.value
            value = yield item

    def __repr__(self):
        return f"<jax-tap verbose of {getattr(self.__wrapped__, '__qualname__', self.__wrapped__)!r}>"


_DISABLED_WARNED = []


def _warn_disabled():
    if not _DISABLED_WARNED:
        _DISABLED_WARNED.append(True)
        warn_once_now("jax-tap: jax.disable_jit() is active: loops run as Python loops, so nothing is tapped.")


def configure(config: Config, recorder=None, with_form=False):
    """(plan, consumers, primitive consumers, time taps) of a configuration."""
    _seam.register_key_states()  # (made outside any trace, as a block or wrapper is)
    c = config
    if c.timeline or c.time_taps:
        # before the consumers take its appender; a user's own recorder given
        # as on_step keeps them too (its timeline() places events by them)
        for keeper in (recorder, c.on_step):
            if isinstance(keeper, FlightRecorder):  # (never ask a user object's attributes)
                keeper.keep_times()
    consumers = Consumers(c.on_step, c.alert, c.alert_once, recorder=recorder,
                          on_ys=c.on_ys, alert_ys=c.alert_ys, alert_ys_once=c.alert_ys_once)
    emit_ys = consumers.observes_ys or (c.select_ys is not None and recorder is not None)
    plan = build_plan(c, emit_carry=with_form or consumers.observes, emit_ys=emit_ys)
    times = make_time_taps(c, consumers.carry_sink)
    if times is not None and recorder is not None:
        recorder._spans = times
    return plan, consumers, prim_consumers(plan.prim_taps, recorder, consumers.on_step), times


def make_tapped(f, config: Config, recorder=None) -> Tapped:
    if not callable(f):
        raise TypeError(f"jax-tap: expected a function to observe, got {type(f).__name__}: {f!r}")
    return Tapped(f, *configure(config, recorder))


def verbose(f: Callable, *, on_step: Optional[Callable] = None, select: Optional[Callable] = None,
            alert: Optional[Callable] = None, alert_once: bool = False,
            ops: Union[str, Sequence[str]] = ("scan", "while_loop"), sample_every: int = 1,
            where: Optional[Callable] = None, max_depth: Optional[int] = None, taps: Sequence[PrimTap] = (),
            select_ys: Optional[Callable] = None, on_ys: Optional[Callable] = None,
            alert_ys: Optional[Callable] = None, alert_ys_once: bool = False,
            flush_every: Optional[int] = None, jit_events: bool = False, trace_events: bool = False,
            max_compiles: Optional[int] = None, timeline: bool = False, per_shard: bool = False,
            backward: bool = False) -> Callable:
    """Observe every ``scan`` / ``while_loop`` step of ``f``, live.

    Returns a function with ``f``'s name and docstring whose outputs and
    gradients are bitwise identical to ``f``'s, and which streams a
    :class:`TapEvent` to ``on_step`` for every sampled loop iteration while
    the compiled program runs.

    Parameters
    ----------
    f : callable
        The function to observe (unmodified).
    on_step : callable, optional
        Host-side consumer, called with each carry :class:`TapEvent`.
    select : callable, optional
        Device-side reducer over the flat tuple of the carry's leaves; may
        return any pytree. ``None`` ships every leaf; ``lambda _: ()`` ships
        only the step. A ``path`` keyword (or a second parameter) receives
        the node address.
    alert : callable, optional
        Host-side predicate on each carry event; a ``str`` return is the
        message, another truthy value prints ``alert``.
    alert_once : bool
        Print the alert line at most once per path per call (the alert
        itself still runs on every event).
    ops : tuple of str
        Loop kinds that emit: ``"scan"``, ``"while_loop"``.
    sample_every : int
        Observe steps whose index is a multiple of this (gated on device).
    where : callable, optional
        ``where(path) -> bool`` chooses the loops that emit.
    max_depth : int, optional
        Only loops whose path has at most this many ``/`` emit.
    taps : sequence
        Primitive taps from :func:`on`, :func:`watch_nan`, :func:`print`.
    select_ys, on_ys, alert_ys, alert_ys_once
        Y-taps: the same machinery for the ``ys`` a scan body returns each
        step (``select_ys`` gets their flat leaves); events have
        ``kind="output"`` and go to ``on_ys``/``alert_ys``. A carry tap and a
        y-tap of one step cross to the host in one callback.
    flush_every : int, optional
        Buffered streaming: keep ``flush_every`` sampled steps in a device
        buffer and ship them in one host hop (plus one at loop exit for the
        partial buffer). Carries, scan outputs and primitive taps are all
        buffered; an inner scan no longer than ``flush_every`` rides in its
        outer step's buffer; a while loop nested in another loop buffers at
        most 64 rows per flush (it flushes at its own end anyway). Consumers
        still receive one TapEvent per step and tap (or TapBlocks, see
        ``FlightRecorder``), in step order; a loop that never ends still
        reports every ``flush_every`` samples.
    jit_events : bool
        Also deliver one ``TapEvent(kind="compile")`` per compilation of a
        jitted function during the call, at ``jit(name)@file.py:LINE``: its
        tracing / lowering / compiling seconds, persistent-cache outcome,
        program size and, for a recompilation, the reason (README, "Jit
        events and trace events").
    trace_events : bool
        Also deliver one ``TapEvent(kind="trace")`` per loop each time JAX
        stages it, at the loop's address: carry types, weak-type promotion,
        body size. Nothing is added to the compiled program.
    max_compiles : int, optional
        Print ``[tap] FAIL jit(f)@file.py:LINE compiled N times: <reason>``
        the moment a jitted function passes this many compilations (implies
        ``jit_events``).
    timeline : bool
        Keep each event's arrival time, for :meth:`FlightRecorder.timeline`
        (implied by ``jit_events`` and ``trace_events``).
    per_shard : bool
        Under a sharded ``jit`` whose values hold their sharding in their
        types (explicit mesh axes, ``jax.make_mesh``'s default), ship each
        shard's piece from its own device (events tagged ``shard``) instead
        of gathering the selected values to one device; buffers stay
        sharded too. Inside ``shard_map`` events are per shard anyway
        (README, "Many devices").
    backward : bool
        Cotangent taps: under ``jax.grad`` / ``jax.vjp`` /
        ``jax.linear_transpose``, the backward loop of each forward ``scan``
        reports ``TapEvent(kind="cotangent")`` at the *forward* loop's
        address, with ``step`` the forward step it belongs to and ``select``
        applied to the cotangent of the forward carry (leaves in the forward
        order; ``.params``: the accumulated cotangents of the closed-over
        values); primitive taps in it report ``backward=True`` (README,
        "The backward pass"). Without it a backward loop is a loop of its
        own address (``scan[1]``), counting its own steps.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> def f(x0):
    ...     return jax.lax.scan(lambda c, _: (c * 2.0, None), x0, None, length=3)
    >>> seen = []
    >>> g = tap.verbose(f, on_step=seen.append, select=lambda leaves: leaves[0])
    >>> out = jax.block_until_ready(g(jnp.float32(1.0)))
    >>> jax.effects_barrier()
    >>> [(e.path, e.step, float(e.value)) for e in seen]
    [('scan[0]', 0, 2.0), ('scan[0]', 1, 4.0), ('scan[0]', 2, 8.0)]
    """
    return make_tapped(f, Config.of(locals()))
