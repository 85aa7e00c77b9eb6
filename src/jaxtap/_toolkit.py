"""The toolkit: primitive taps (``on``, ``watch_nan``, ``print``) and
``primitives`` discovery, plus their host-side consumers."""
from __future__ import annotations

import builtins
import difflib
import dis
import threading
from typing import Callable, Optional

import jax

from . import _loops  # noqa: F401 - registers the scan and while rules
from ._transform import tappable_names
from ._event import TapEvent
from ._host import Alerter, _say, at, value_repr, warn_once_now
from ._options import PrimTap


_LOOP_NAMES = frozenset({"scan", "while", "while_loop"})


def _check_prim_args(prim_name, select, output, label, once):
    if not isinstance(prim_name, str) or not prim_name:
        raise TypeError(
            f"jax-tap: the primitive name must be a non-empty str such as 'cholesky', got {prim_name!r}. "
            "tap.primitives(f, *args) lists the names in your program."
        )
    if prim_name in _LOOP_NAMES:
        raise ValueError(
            f"jax-tap: {prim_name!r} is a loop: its carries are tapped by tap.record/tap.verbose themselves "
            "(choose loops with `ops=`, `where=` or `max_depth=`, shape what crosses with `select=`); "
            "tap.on/tap.print/tap.watch_nan tap the primitives inside loops."
        )
    if select is not None and not callable(select):
        raise TypeError(f"jax-tap: `select` must be callable (or None), got {select!r}")
    if output is not None and (isinstance(output, bool) or not isinstance(output, int) or output < 0):
        raise ValueError(f"jax-tap: `output` must be None or an int >= 0 (an index into the primitive's outputs), got {output!r}")
    if label is not None and not isinstance(label, str):
        raise TypeError(f"jax-tap: `label` must be a str, got {label!r}")
    if not isinstance(once, bool):
        raise TypeError(f"jax-tap: `once` must be True or False, got {once!r}")


def on(prim_name: str, select: Optional[Callable] = None, alert: Optional[Callable] = None,
       label: Optional[str] = None, output: Optional[int] = None, once: bool = False) -> PrimTap:
    """Tap the outputs of every equation of one primitive kind.

    ``select`` runs on device on the tuple of the primitive's outputs (only
    output ``output`` when given); ``alert`` runs on the host on the selected
    value; a ``str`` return is the message, another truthy value prints
    ``label``: ``[tap] FAIL {path} {step}/{total}: {message}``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> def f(x0, xs):
    ...     return jax.lax.scan(lambda c, x: (c + jnp.sin(x), c), x0, xs)
    >>> with tap.record(taps=[tap.on("sin", select=lambda outs: outs[0],
    ...                               alert=lambda v: v > 0.99, label="sin near 1")]):
    ...     _ = jax.block_until_ready(f(jnp.float32(0.0), jnp.array([0.0, 1.5708])))
    """
    _check_prim_args(prim_name, select, output, label, once)
    if alert is not None and not callable(alert):
        raise TypeError(f"jax-tap: `alert` must be callable (or None), got {alert!r}")
    return PrimTap(prim_name, select=select, alert=alert, label=label, output=output, once=once, mode="on")


def watch_nan(prim_name: Optional[str] = None, label: Optional[str] = None, output: Optional[int] = None,
              once: Optional[bool] = None) -> PrimTap:
    """Alert live when a primitive's floating-point output is not finite.

    The check runs on device; the host hears only about firings that trip.
    With no ``prim_name``, every equation that produces floating-point
    values is watched and each NaN/Inf **birth site** is reported - an
    equation whose inputs are all finite but whose output is not - with its
    address and step, without halting or re-running anything; ``once``
    defaults to True there (the first birth of a run, then quiet).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> def f(c0, xs):
    ...     return jax.lax.scan(lambda c, x: (c + jnp.log(x), None), c0, xs)
    >>> with tap.record(taps=[tap.watch_nan("log", once=True)]):   # doctest: +SKIP
    ...     f(jnp.float32(0.0), jnp.array([1.0, 0.0, 2.0]))
    [tap] FAIL scan[0]/log[0] 1/3: NaN/Inf
    """
    if prim_name is None:
        once = True if once is None else once
        _check_prim_args("any", None, output, label, once)
        return PrimTap(None, label=label or "NaN/Inf born here (inputs finite)", once=once, mode="nan_birth")
    once = False if once is None else once
    _check_prim_args(prim_name, None, output, label, once)
    return PrimTap(prim_name, label=label or "NaN/Inf", output=output, once=once, mode="nan")


def print(prim_name: str, output: Optional[int] = None, select: Optional[Callable] = None,  # noqa: A001
          label: Optional[str] = None, once: bool = False) -> PrimTap:
    """Print each firing of a primitive to stderr, one line per firing:
    ``[tap] {path} {step}/{total}: {value}`` (numpy repr, precision 4,
    arrays over 8 elements truncated).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> def f(x0, xs):
    ...     return jax.lax.scan(lambda c, x: (c * x, None), x0, xs)
    >>> with tap.record(taps=[tap.print("mul")]):   # doctest: +SKIP
    ...     f(jnp.float32(1.0), jnp.array([0.5, 0.5]))
    [tap] scan[0]/mul[0] 0/2: array([0.5], dtype=float32)
    [tap] scan[0]/mul[0] 1/2: array([0.25], dtype=float32)
    """
    _check_prim_args(prim_name, select, output, label, once)
    return PrimTap(prim_name, select=select, label=label, output=output, once=once, mode="print")


def _nan_verdict(born: bool):
    """A tripwire fired: the label, or in the backward pass (where the value
    names the primitive and the user line) the message saying so."""
    def verdict(value):
        if isinstance(value, str):
            return f"NaN/Inf born in {value}" if born else f"NaN/Inf in {value}"
        return True

    return verdict


class PrimConsumer:
    """Host side of one primitive tap for one receiver."""

    def __init__(self, t: PrimTap, recorder=None, on_step=None):
        self.tap = t
        self.recorder = recorder
        self.on_step = on_step  # a Guard: every event reaches on_step, by kind (0.3.1)
        self._printed: set = set()
        self._lock = threading.Lock()
        if t.mode in ("nan", "nan_birth"):
            # the device ships only firings that tripped
            self.alerter = Alerter(_nan_verdict(t.mode == "nan_birth"), t.once, t.label or "NaN/Inf", on_value=True,
                                   once_key=(lambda e: "run") if t.mode == "nan_birth" else None)
        elif t.mode == "on" and t.alert is not None:
            self.alerter = Alerter(t.alert, t.once, t.label or "alert", on_value=True)
        else:
            self.alerter = None

    def new_run(self):
        if self.alerter is not None:
            self.alerter.reset()
        with self._lock:
            self._printed.clear()

    def _first(self, path) -> bool:
        """False once a ``once`` print has shown this address (its events are still recorded)."""
        if not self.tap.once:
            return True
        with self._lock:
            if path in self._printed:
                return False
            self._printed.add(path)
            return True

    def deliver(self, event: TapEvent, top=None) -> None:
        if self.alerter is not None:
            self.alerter(event)
        elif self.tap.mode == "print" and self._first(event.path):
            prefix = f"{self.tap.label} " if self.tap.label else ""
            _say(f"[tap] {prefix}{at(event)}: {value_repr(event.value)}")
        if self.recorder is not None:
            self.recorder.append(event)
        if self.on_step is not None:
            self.on_step(event)


def primitives(f: Callable, *args, **kwargs) -> dict:
    """Trace ``f(*args, **kwargs)`` once and count its primitives by name,
    including inside loop bodies, branches and inner jits.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> def f(x0, xs):
    ...     return jax.lax.scan(lambda c, x: (c * 1.01 + jnp.sin(x), c), x0, xs)
    >>> sorted(tap.primitives(f, jnp.float32(0.0), jnp.ones(3)))
    ['add', 'mul', 'scan', 'sin']
    """
    if not callable(f):
        raise TypeError(f"jax-tap: primitives(f, *args) needs a callable f, got {f!r}")
    closed = jax.make_jaxpr(f)(*args, **kwargs)
    return tappable_names(closed.jaxpr)


def warn_unmatched(taps, names_seen) -> None:
    """Warn, at trace time, about tap names that match no equation."""
    known = builtins.sorted(names_seen)
    for t in taps:
        if t.prim is None or t.prim in names_seen:
            continue
        close = difflib.get_close_matches(t.prim, known, n=3)
        hint = f"; did you mean {close[0]!r}?" if close else f"; the program has: {', '.join(known[:12])}"
        warn_once_now(f"jax-tap: tap name {t.prim!r} matched nothing{hint}")


def warn_where_unmatched(where, asked, recorder) -> None:
    """Warn when ``where`` chose none of the loops it was asked about
    (``asked``: path -> answer) and the block heard from no loop; not when
    ``where`` says no to every loop by construction (``lambda p: False``)."""
    if not asked or any(asked.values()) or _always_false(where) or any(e.kind != "primitive" for e in recorder.events):
        return
    paths = ", ".join(list(asked)[:8]) + (", ..." if len(asked) > 8 else "")
    warn_once_now(f"jax-tap: `where` chose none of the loops it was asked about ({paths}); no loop sent an "
                  "event. `where` receives these paths: e.g. where=lambda path: path.startswith('while[0]').")


def _always_false(fn) -> bool:
    """Is ``fn``'s whole body ``return False``?"""
    try:
        ops = [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname not in ("RESUME", "NOP", "CACHE")]
    except TypeError:  # not Python code
        return False
    return ops in ([("LOAD_CONST", False), ("RETURN_VALUE", None)], [("RETURN_CONST", False)])


def prim_consumers(taps, recorder=None, on_step=None):
    return [PrimConsumer(t, recorder, on_step) for t in taps]

