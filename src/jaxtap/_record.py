"""The with-form: ``with tap.record(...) as rec:`` blocks (lifecycle; the
interception and routing they share with ``tap.verbose`` are in ``_lens``)."""
from __future__ import annotations

import sys
import threading
from typing import Callable, Optional, Sequence, Tuple, Union

from . import _seam
from ._collectors import FlightRecorder
from ._host import explain, unwatch_interrupts, warn_once_now, watch_interrupts
from ._lens import _REGISTRY, SiteIndex, interception_unavailable
from ._toolkit import warn_unmatched, warn_where_unmatched
from ._options import Config, PrimTap
from ._verbose import Tapped, configure, make_tapped

class TapContext:
    """The with-form: ``with tap.record(**cfg) as rec:``.

    Entering returns the :class:`FlightRecorder` that receives every event
    of the block. See :func:`record`.
    """

    shared = True  # the sole active block also taps threads without one (see _lens._Registry.sole)
    barrier = None  # every loop the block's thread executes

    def __init__(self, recorder: Optional[FlightRecorder] = None, config: Optional[Config] = None, **cfg):
        self.recorder = recorder if recorder is not None else FlightRecorder()
        config = Config.from_keywords(cfg) if config is None else config
        self._plan, self._consumers, self._prims, self._times = configure(config, self.recorder, with_form=True)
        self._token = None
        self._thread = None
        self._active = False
        self._names_seen: set = set()
        self._sites = SiteIndex()

    @property
    def events(self):
        return self.recorder.events

    def __enter__(self) -> FlightRecorder:
        if self._active:
            raise RuntimeError(
                "jax-tap: this tap.record() context is already active; create a new one "
                "(tap.record(...)) for a nested or concurrent block."
            )
        if interception_unavailable("the block"):
            return self.recorder
        if _seam.BUSY.depth:  # inside a consumer (or jax-tap's own tracing): JAX work there is never tapped
            warn_once_now("jax-tap: a tap.record() block entered inside a jax-tap consumer (an on_step, alert "
                          "or on_block) records nothing: JAX work a consumer runs is never tapped. Open the "
                          "block outside the consumer.")
            return self.recorder
        self._thread = threading.get_ident()
        self._token = _REGISTRY.token_for(self._plan, self._thread)
        self._token.walker.sinks.guard.rearm()  # (shared by equal blocks: each one hears of a failure)
        self._active = True
        self._names_seen = set()
        self._sites = SiteIndex()
        self._consumers.new_run()
        for p in self._prims:
            p.new_run()
        if self._times is not None:
            self._times.new_run()
        _REGISTRY.push(self)
        watch_interrupts()
        return self.recorder

    def __exit__(self, exc_type, exc, tb, _sys=sys):
        if not self._active or _sys.is_finalizing():  # (at exit, a generator held open closes it:
            return False                              # this module's globals may be gone already)
        try:
            _seam.effects_barrier()  # deliver every event of work dispatched inside
        except Exception:  # noqa: BLE001 - a failed program already raised its own error
            pass
        finally:
            self._active = False
            _REGISTRY.remove(self, self._thread)
            interrupt = unwatch_interrupts(exc)
            explain(exc)
        if threading.get_ident() != self._thread:
            warn_once_now("jax-tap: a tap.record() block was exited on another thread than the one that entered "
                          "it; exit it on the thread that entered it. Functions that thread jitted inside the "
                          "block keep their tapped compilations there (their events go nowhere) until it enters "
                          "or exits another block.")
        if self._plan.prim_taps and self._names_seen:
            warn_unmatched(self._plan.prim_taps, self._names_seen)
        if self._plan.where is not None and not self._plan.prim_taps and self._times is None:  # (loops alone)
            warn_where_unmatched(self._plan.where, self._token.walker.where_asked, self.recorder)
        if interrupt is not None:  # a Ctrl-C stopped the run: say it as Python would
            raise interrupt from exc
        return False

    def __repr__(self):
        state = "active" if self._active else "inactive"
        return f"<tap.record context ({state}), {len(self.recorder)} events>"


def record(fn: Optional[Callable] = None, /, *, on_step: Optional[Callable] = None,
           select: Optional[Callable] = None, alert: Optional[Callable] = None, alert_once: bool = False,
           ops: Union[str, Sequence[str]] = ("scan", "while_loop"), sample_every: int = 1,
           where: Optional[Callable] = None, max_depth: Optional[int] = None, taps: Sequence[PrimTap] = (),
           select_ys: Optional[Callable] = None, on_ys: Optional[Callable] = None,
           alert_ys: Optional[Callable] = None, alert_ys_once: bool = False,
           flush_every: Optional[int] = None, jit_events: bool = False, trace_events: bool = False,
           max_compiles: Optional[int] = None, timeline: bool = False, per_shard: bool = False,
           backward: bool = False,
           maxlen: Optional[int] = None) -> Union[TapContext, Tuple[Tapped, FlightRecorder]]:
    """Record loop telemetry: as a with-block around unmodified code, or by
    wrapping a function.

    ``with tap.record(**cfg) as rec:`` taps every ``scan``/``while_loop`` the
    block executes (including functions jitted before the block, library
    code, ``fori_loop`` and ``lax.map``); ``g, rec = tap.record(f, **cfg)``
    returns an observed ``f`` and its recorder. Both forms take
    :func:`verbose`'s keyword arguments and produce the same events.

    Parameters
    ----------
    fn : callable, optional
        Wrap this function instead of returning a context manager.
    maxlen : int, optional
        Keep only the last ``maxlen`` events in the recorder.
    **cfg
        As for :func:`verbose`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> def f(x0, xs):
    ...     return jax.lax.scan(lambda c, x: (c * 1.01 + jnp.sin(x), c), x0, xs)
    >>> with tap.record(select=lambda leaves: {"c": leaves[0]}) as rec:
    ...     _ = f(jnp.float32(0.0), jnp.linspace(0.0, 1.0, 100))
    >>> rec.events[-1].path, rec.events[-1].step, rec.events[-1].total
    ('scan[0]', 99, 100)
    """
    config = Config.of(locals())
    rec = FlightRecorder(maxlen=maxlen)
    if fn is None:
        return TapContext(recorder=rec, config=config)
    return make_tapped(fn, config, recorder=rec), rec


def emergency_restore() -> None:
    """Reset jax-tap to a clean slate: remove every interception, forget
    every active context, clear this thread's jit-key token."""
    _REGISTRY.reset()


def active_contexts() -> int:
    """How many with-blocks and wrapped calls are active (all threads)."""
    return _REGISTRY.n_active
