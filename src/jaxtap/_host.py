"""Host-side delivery: consumers, alert lines, and callback totality.

Nothing a consumer does may change or crash the user's program: every
consumer runs behind a guard that swallows its exceptions and warns once
(falling back to a plain stderr line when warnings themselves raise, as
under ``python -W error``). One exception passes: ``KeyboardInterrupt``
(see :func:`pass_interrupt`).
"""
from __future__ import annotations

import sys
import threading
import warnings
from typing import Any, Callable, Optional

import numpy as np

from ._event import TapEvent


class TapWarning(RuntimeWarning, UserWarning):
    """A telemetry consumer failed; the program itself was not touched.
    (Also a ``UserWarning``, as in jax-tap 0.3.1, so filters on either work.)"""


def pass_interrupt(exc: BaseException) -> None:
    """Re-raise a ``KeyboardInterrupt``; return for anything else.

    On CPU a hop runs on the thread that waits for the program, so a Ctrl-C
    during a tapped run usually lands in a consumer or in jax-tap's host
    code. It is the user's, not a consumer's failure: swallowed, it would
    leave the run impossible to stop. Raised out of the hop it stops the run
    as it stops one holding a ``jax.debug.callback`` (XLA reports it as a
    runtime error, which a block's exit turns back into a
    ``KeyboardInterrupt``: :func:`interrupt_of`).
    """
    if isinstance(exc, KeyboardInterrupt):
        _SIGINT.pending = False  # (on its way)
        raise exc


class _SigintWatch:
    """A Ctrl-C that Python dropped while a block was active.

    Python raises ``KeyboardInterrupt`` at the next bytecode, which can be
    inside a garbage-collection callback that a hop's allocations trigger
    (JAX's ``_xla_gc_callback``) or a finalizer, where Python drops it and
    hands it to ``sys.unraisablehook`` ("Exception ignored"). While a block
    is active, a hook of ours notes such a drop (then calls the hook it
    replaced); the next hop, or the block's exit, raises it. An interrupt
    that reached the user's code is the user's: never raised again. No
    signal handler is touched.
    """

    lock = threading.Lock()
    depth = 0
    # the unraisable hook ours wraps; kept after the blocks end, for a
    # save/restore elsewhere may put ours back, which must still forward there
    replaced = None
    pending = False


_SIGINT = _SigintWatch()


def _on_unraisable(unraisable, _watch=_SIGINT, _sys=sys) -> None:
    # (defaults: at interpreter exit, with a block still open, this module's
    # globals may already be None)
    if _watch.depth and isinstance(getattr(unraisable, "exc_value", None), KeyboardInterrupt):
        _watch.pending = True
    replaced = _watch.replaced or _sys.__unraisablehook__
    replaced(unraisable)


def watch_interrupts() -> None:
    """A block begins (see :class:`_SigintWatch`); pair with :func:`unwatch_interrupts`."""
    with _SIGINT.lock:
        _SIGINT.depth += 1
        if _SIGINT.depth == 1 and sys.unraisablehook is not _on_unraisable:
            _SIGINT.replaced, sys.unraisablehook = sys.unraisablehook, _on_unraisable


def unwatch_interrupts(exc: Optional[BaseException]) -> Optional[KeyboardInterrupt]:
    """A block ends: the interrupt to raise in place of ``exc`` (or after a
    clean exit, one whose ``KeyboardInterrupt`` Python dropped), or None."""
    with _SIGINT.lock:
        _SIGINT.depth = max(0, _SIGINT.depth - 1)
        lost = _SIGINT.pending and _SIGINT.depth == 0
        if _SIGINT.depth == 0:
            _SIGINT.pending = False
            if sys.unraisablehook is _on_unraisable:  # (a hook set since then is the user's: kept)
                sys.unraisablehook = _SIGINT.replaced or sys.__unraisablehook__
    if isinstance(exc, KeyboardInterrupt):
        return None
    if exc is None:
        return KeyboardInterrupt() if lost else None  # (Python dropped it: say it now)
    return interrupt_of(exc)


def raise_lost_interrupt() -> None:
    """At a hop: raise a Ctrl-C whose ``KeyboardInterrupt`` Python dropped."""
    if _SIGINT.pending:
        _SIGINT.pending = False
        raise KeyboardInterrupt


def interrupt_of(exc: Optional[BaseException]) -> Optional[KeyboardInterrupt]:
    """The ``KeyboardInterrupt`` a block raises in place of ``exc``, the
    runtime error XLA reports for a Ctrl-C that stopped a host callback
    (jax-tap's or the user's own ``jax.debug.callback``); None otherwise.

    XLA's message ends with the callback's exception line: it must be a
    bare ``KeyboardInterrupt`` (a user error that merely mentions one in
    its message stays the user's error)."""
    from ._seam import RUNTIME_ERRORS  # (here: the seam's callbacks import this module)
    if not isinstance(exc, RUNTIME_ERRORS):
        return None
    try:
        last = str(exc).rstrip().rsplit("\n", 1)[-1].strip()
    except Exception:  # noqa: BLE001 - a message that cannot be read is not an interrupt's
        return None
    return KeyboardInterrupt() if last == "KeyboardInterrupt" or last.startswith("KeyboardInterrupt:") else None


def explain(exc: Optional[BaseException]) -> None:
    """Add a note naming the fix to an error a block caused by design: a
    program traced inside a block holds jax-tap's host callbacks, which
    ``jax.export`` (JAX's "serialization of host_callbacks") cannot save."""
    try:
        if (isinstance(exc, NotImplementedError) and "host_callback" in str(exc)
                and not any("jax-tap" in n for n in getattr(exc, "__notes__", ()))):
            exc.add_note("jax-tap: this program was traced inside a tap.record/verbose block, so it holds "
                         "jax-tap's host callbacks: call jax.export outside the block.")
    except Exception:  # noqa: BLE001 - a note is a courtesy
        pass


def describe(exc: BaseException) -> str:
    """``"Type: message"`` of an exception, even one whose ``__str__`` raises."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: BLE001 - its text cannot be made: its type still names it
        return f"{type(exc).__name__} (its message could not be formatted)"


def name_of(fn) -> str:
    """A consumer's name for a warning, even for an object whose attribute
    lookup or ``repr`` raises."""
    for read in (lambda: getattr(fn, "__qualname__", None), lambda: repr(fn)):
        try:
            name = read()
            if isinstance(name, str) and name:
                return name
        except BaseException as exc:  # noqa: BLE001 - a consumer's own failure, not ours
            pass_interrupt(exc)
    return f"<a {type(fn).__name__}>"


def _say(text: str, stream=None, end: str = "\n") -> None:
    """Write ``text`` to ``stream`` (stderr as it is now); never raise."""
    try:
        stream = sys.stderr if stream is None else stream
        if stream is None:
            return
        stream.write(text + end)
        stream.flush()
    except BaseException as exc:  # noqa: BLE001 - a closed or broken stream (even one raising
        pass_interrupt(exc)      # SystemExit) must not disturb the program; Ctrl-C is the user's


_SAID: set = set()  # warnings written to stderr because warnings were errors: each once


def warn_once_now(message: str) -> None:
    """Issue a TapWarning; if warnings are errors, fall back to stderr (each
    message once a process: the warnings registry never records one that
    raised)."""
    try:
        warnings.warn(message, TapWarning, stacklevel=2)
    except BaseException as exc:  # noqa: BLE001 - warnings are errors, or a showwarning that raises
        pass_interrupt(exc)
        if message not in _SAID:
            _SAID.add(message)
            _say(f"[tap] warning: {message}")


def _no_key() -> None:
    return None


# Before a user's consumer runs in a hop: give the thread the clean jit key.
# The seam's host entry installs it as it loads (``_seam.callback.consumer_key``;
# the seam imports this module, so this module never imports the seam).
consumer_key = _no_key


class Guard:
    """Runs one consumer; swallows its failures and warns about them once."""

    __slots__ = ("fn", "role", "_warned", "_lock")

    def __init__(self, fn: Callable, role: str):
        self.fn = fn
        self.role = role
        self._warned = False
        self._lock = threading.Lock()

    def __call__(self, x, top=None) -> Any:
        try:
            consumer_key()  # what a consumer compiles is never cached as the block's
            return self.fn(x)
        except BaseException as exc:  # noqa: BLE001 - totality: even sys.exit in a consumer
            self.failed(exc)
            return None

    def rearm(self) -> None:
        """Warn again at the next failure (a new block that shares this
        guard with an earlier one of equal options)."""
        self._warned = False

    def failed(self, exc: BaseException) -> None:
        """Warn once that the consumer raised ``exc`` (a Ctrl-C is re-raised:
        :func:`pass_interrupt`)."""
        pass_interrupt(exc)
        with self._lock:
            if self._warned:
                return
            self._warned = True
        name = name_of(self.fn)
        warn_once_now(
            f"jax-tap: the {self.role} {name} raised {describe(exc)}. "
            "The program is unaffected; further failures of this consumer are silent."
        )


def fmt_total(total: Optional[int]) -> str:
    return "?" if total is None else str(total)


def at(event: TapEvent) -> str:
    """``path step/total``; just ``path`` for a primitive outside any loop;
    ``(backward)`` after the path for an event of the backward pass;
    then ``[process P, shard S]`` for an event of many devices or processes."""
    path = f"{event.path} (backward)" if event[9] else event.path
    where = path if event.step == -1 and event.total is None else f"{path} {event.step}/{fmt_total(event.total)}"
    origin = [f"{name} {tag}" for name, tag in (("process", event[8]), ("shard", event[6])) if tag is not None]
    return f"{where} [{', '.join(origin)}]" if origin else where


def fail_line(event: TapEvent, message: str) -> str:
    return f"[tap] FAIL {at(event)}: {message}"


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines())


def value_repr(value: Any) -> str:
    """One-line numpy repr with the toolkit's print options.

    Scalars print as 1-element arrays (``array([0.8499], dtype=float32)``),
    as in the spec's examples; a multi-output primitive prints its outputs
    in primitive order, separated by ``", "``.
    """
    with np.printoptions(precision=4, threshold=8, edgeitems=2):
        if isinstance(value, tuple) and value and all(isinstance(v, (np.ndarray, np.generic)) for v in value):
            return ", ".join(_one_line(repr(np.atleast_1d(v))) for v in value)
        if isinstance(value, (np.ndarray, np.generic)):
            return _one_line(repr(np.atleast_1d(value)))
        return _one_line(repr(value))


class Alerter:
    """Evaluates an alert predicate for an event and prints a FAIL line."""

    def __init__(self, predicate: Callable, once: bool, label: str = "alert", on_value: bool = False,
                 once_key: Optional[Callable] = None):
        self.guard = Guard(predicate, "alert")
        self.once = once
        self.once_key = once_key or (lambda e: e.path)
        self.label = label
        self.on_value = on_value  # primitive taps pass the value, carry alerts the event
        self._fired: set = set()
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self._fired.clear()

    def __call__(self, event: TapEvent) -> None:
        # the predicate runs on every event, `once` included (the spec and
        # jax-tap 0.3.1: "alert runs before on_step; both run"); `once`
        # silences the printed line after the first firing
        key = self.once_key(event)
        try:
            verdict = self.guard(event.value if self.on_value else event)
            if isinstance(verdict, str):
                message = verdict
            elif _truthy(verdict, self.guard):
                message = self.label
            else:
                return
            line = fail_line(event, message)  # (a str subclass may format badly)
        except BaseException as exc:  # noqa: BLE001 - totality, as Guard
            self.guard.failed(exc)
            return
        if self.once:
            with self._lock:
                if key in self._fired:
                    return
                self._fired.add(key)
        _say(line)


def _truthy(verdict: Any, guard: Guard) -> bool:
    try:
        return bool(verdict)
    except BaseException as exc:  # noqa: BLE001 - e.g. an array with many elements
        guard.failed(exc)
        return False


class Consumers:
    """The host-side fan-out for one tap configuration.

    Carry events: ``alert``, then the recorder, then ``on_step``. Scan-output
    events: ``alert_ys``, then the recorder, then ``on_ys``.
    """

    def __init__(self, on_step=None, alert=None, alert_once=False, recorder=None,
                 on_ys=None, alert_ys=None, alert_ys_once=False):
        self.alert = Alerter(alert, alert_once) if alert is not None else None
        self.recorder = recorder
        self.on_step = Guard(on_step, "on_step callback") if on_step is not None else None
        self.alert_ys = Alerter(alert_ys, alert_ys_once) if alert_ys is not None else None
        self.on_ys = Guard(on_ys, "on_ys callback") if on_ys is not None else None
        # ``sink(event, top=None)`` per event kind, as lean as the setup allows
        self.carry_sink = _sink(self.alert, self.recorder, self.on_step)
        self.ys_sink = _sink(self.alert_ys, self.recorder, self.on_ys)

    @property
    def observes(self) -> bool:
        return any(x is not None for x in (self.alert, self.recorder, self.on_step))

    @property
    def observes_ys(self) -> bool:
        return self.alert_ys is not None or self.on_ys is not None

    def new_run(self) -> None:
        for a in (self.alert, self.alert_ys):
            if a is not None:
                a.reset()

    def deliver(self, event: TapEvent, top=None) -> None:
        (self.ys_sink if event.kind == "output" else self.carry_sink)(event)


def _sink(alert, recorder, consumer):
    sink = _event_sink(alert, recorder, consumer)
    columns = _columns_sink(alert, recorder, consumer)
    if columns is not None:
        if sink is consumer or sink is _nothing:  # never decorate the user's own callable
            sink = _forward(sink)
        sink.columns = columns
        keeps = getattr(recorder, "_keeps_bytes", None)
        if alert is None and consumer is None and keeps is not None and keeps():
            sink.raw_rows = columns  # a recorder alone, unbounded: it may keep a hop's bytes
            sink.keep_bytes = recorder._keep_bytes  # (one event's, in its run: no block)
    return sink


def _forward(fn):
    def sink(event, top=None):
        return fn(event)

    return sink


def _columns_sink(alert, recorder, consumer):
    """``columns(block)`` when every consumer of this sink takes a TapBlock
    whole (the recorder, an ``on_step`` with ``on_block``); None when one
    needs events (an alert, a plain ``on_step``)."""
    if alert is not None or (recorder is None and consumer is None):
        return None
    record = None
    if recorder is not None:
        appender = getattr(recorder, "_block_appender", None)
        record = appender() if appender is not None else None
        if record is None:
            return None
    on_block = None
    if consumer is not None:
        on_block = block_method(consumer.fn)
        if on_block is None:
            return None
    guard = consumer

    def columns(block):
        if record is not None:
            try:
                record(block)
            except Exception:  # noqa: BLE001
                pass
        if on_block is not None:
            try:
                consumer_key()
                on_block(block)
            except BaseException as exc:  # noqa: BLE001 - totality, as Guard
                guard.failed(exc)

    return columns


def block_method(consumer):
    """``consumer.on_block`` when its class defines one at least as specific
    as its ``__call__`` (a subclass that changes ``__call__`` only still
    wants events; a mock's made-up attribute does not count)."""
    cls = type(consumer)
    mro = cls.__mro__
    owner = next((i for i, c in enumerate(mro) if "on_block" in c.__dict__), None)
    if owner is None or not callable(mro[owner].__dict__["on_block"]):
        return None
    caller = next((i for i, c in enumerate(mro) if "__call__" in c.__dict__), len(mro))
    if owner > caller:
        return None
    return getattr(consumer, "on_block", None)


def _event_sink(alert, recorder, consumer):
    if alert is None and recorder is None:
        return consumer if consumer is not None else _nothing
    record = None
    if recorder is not None:
        appender = getattr(recorder, "_appender", None)
        record = appender() if appender is not None else recorder.append

    if alert is None and consumer is None:
        def sink(event, top=None):
            try:
                record(event)
            except Exception:  # noqa: BLE001
                pass

        return sink

    def sink(event, top=None):
        if alert is not None:
            alert(event)
        if record is not None:
            try:
                record(event)
            except Exception:  # noqa: BLE001
                pass
        if consumer is not None:
            consumer(event)

    return sink


def _nothing(event, top=None):
    return None
