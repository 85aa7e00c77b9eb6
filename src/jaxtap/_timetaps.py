"""Jit-event and trace-time taps: what JAX does *before* a program runs.

* **jit events** (``jit_events=True``): one ``TapEvent(kind="compile")`` per
  compilation of a jitted function in a scope, at ``jit(name)@file.py:LINE``,
  with its tracing / lowering / compiling times (JAX's monitoring spans, on
  the compiling thread), the persistent-cache outcome, the size of the
  program and, from the second compilation of a function on, the *reason*:
  what changed in its arguments (``x: f32[8] (was f32[4])``, a weak type,
  a static value, the pytree) or in JAX's configuration.
* **trace events** (``trace_events=True``): one ``TapEvent(kind="trace")``
  per loop each time JAX stages it, at the address its runtime events use:
  carry types, weak-type promotions (JAX then traces the body twice), the
  body's size. They are read from the jaxpr at bind time and add nothing to
  the compiled program.

Everything here runs on the host, behind the consumers' guards.
"""
from __future__ import annotations

import inspect
import os
import threading
import time
from typing import Any, Optional

from . import _seam
from ._event import TapEvent
from ._host import _say
from ._transform import Counter

_PHASES = {_seam.monitor.TRACE_SPAN: "trace", _seam.monitor.LOWER_SPAN: "lower",
           _seam.monitor.COMPILE_SPAN: "compile"}


class _Call:
    """One top-level jit call being traced, lowered and compiled."""

    __slots__ = ("path", "signature", "jaxpr", "spans", "cache")

    def __init__(self, path, signature):
        self.path, self.signature = path, signature
        self.jaxpr, self.spans, self.cache = None, {}, "off"


class TimeTaps:
    """A scope's jit-event and trace-time taps (host side).

    ``deliver(event)`` is the scope's consumer fan-out (recorder, ``on_step``,
    ``alert``). ``spans`` keeps every tracing / lowering / compiling span for
    :meth:`FlightRecorder.timeline` as ``(thread, path, phase, start, end)``
    in ``time.time()`` seconds.
    """

    def __init__(self, deliver, jit_events=False, trace_events=False, max_compiles=None):
        self.deliver = deliver
        self.jit_events = jit_events or max_compiles is not None
        self.trace_events = trace_events
        self.max_compiles = max_compiles
        self.spans: list = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self.new_run()

    def new_run(self) -> None:
        self._history: dict = {}  # path -> [signature, ...]
        self._traces: dict = {}  # loop address -> times staged
        self._promoted: dict = {}  # (file, line) -> promoted carries, not yet reported
        self._alerted: set = set()
        self.spans = []

    # ------------------------------------------------------------ jit events
    def on_call(self, fun, ji, args, kwargs):
        """A top-level jit call (before JAX looks it up): remember what it is
        called with; its spans follow on this thread."""
        name, file, line = _seam.monitor.jit_function_site(fun, ji)
        if _seam.BUSY.depth or not _seam.monitor.is_user_file(file):
            self._local.call = None  # JAX's own jits (eager ops) and jax-tap's
            return None
        call = _Call(f"jit({name})@{os.path.basename(file)}:{line}", _signature(fun, ji, args, kwargs))
        self._local.call = call

        def after(params):
            call.jaxpr = _seam.monitor.pjit_jaxpr(params)

        return after

    def on_span(self, event, start, end, fun_name):
        phase = _PHASES.get(event)
        call = getattr(self._local, "call", None)
        if phase is None or call is None:
            return
        call.spans[phase] = (start, end)
        with self._lock:
            self.spans.append((threading.get_ident(), call.path, phase, start, end))
        if phase == "compile":
            self._local.call = None
            self._compiled(call)

    def on_event(self, event):
        call = getattr(self._local, "call", None)
        if call is None:
            return
        if event == _seam.monitor.CACHE_HIT:
            call.cache = "hit"
        elif event == _seam.monitor.CACHE_MISS:
            call.cache = "miss"
        elif event == _seam.monitor.CACHE_USED and call.cache == "off":
            call.cache = "miss"

    def _compiled(self, call):
        with self._lock:
            history = self._history.setdefault(call.path, [])
            n = len(history)
            reason = _reason(call.signature, history)
            history.append(call.signature)
        jaxpr = call.jaxpr
        value = {
            "trace_s": _duration(call.spans.get("trace")),
            "lower_s": _duration(call.spans.get("lower")),
            "compile_s": _duration(call.spans.get("compile")),
            "cache": call.cache,
            # the persistent cache keys a program by its callbacks' addresses:
            # one that holds host callbacks never hits in a new process
            "cold_in_new_process": bool(jaxpr is not None and _seam.monitor.has_host_callbacks(jaxpr)),
            "reason": reason,
            "signature": ", ".join(f"{k}: {v}" for k, v in call.signature[0]),
            "eqns": None if jaxpr is None else _seam.monitor.count_eqns(jaxpr),
            "start": call.spans.get("trace", call.spans["compile"])[0],
        }
        event = TapEvent(call.path, n, value, total=None, kind="compile")
        if self.max_compiles is not None and n + 1 > self.max_compiles and call.path not in self._alerted:
            self._alerted.add(call.path)
            line = f"[tap] FAIL {call.path} compiled {n + 1} times: {reason}"
            with self._lock:
                self.spans.append((threading.get_ident(), call.path, "alert", time.time(), line))
            _say(line)
        self.deliver(event)

    # ---------------------------------------------------------- trace events
    def on_promotion(self):
        site = _seam.current_site()
        key = tuple(site[:2])
        with self._lock:
            self._promoted[key] = self._promoted.get(key, 0) + 1

    def on_loop(self, path, prim, params, site):
        """A loop staged at ``path`` (and the loops inside it, at theirs)."""
        self._report(path, prim, params, site)
        for sub_path, eqn in nested_loops(path, _seam.loop_body(prim, params).jaxpr):
            self._report(sub_path, eqn.primitive, eqn.params, _seam.site_of_eqn(eqn))

    def _report(self, path, prim, params, site):
        body = _seam.loop_body(prim, params)
        if prim is _seam.scan_p:
            _, nc, ncar, _ = _seam.scan_parts(params)
            carry = body.in_avals[nc:nc + ncar]
        else:
            _, _, _, bnc = _seam.while_parts(params)
            carry = body.in_avals[bnc:]
        key = tuple(site[:2]) if site else None
        with self._lock:
            n = self._traces.get(path, 0)
            self._traces[path] = n + 1
            promoted = self._promoted.pop(key, 0)
        value = {
            "carry": [_seam.monitor.aval_text(a) for a in carry],
            "weak_promoted": promoted,  # > 0: JAX traced this body twice
            "eqns": _seam.monitor.count_eqns(body.jaxpr),
            "traces": n + 1,
            "time": time.time(),
        }
        self.deliver(TapEvent(path, n, value, total=None, kind="trace"))


def nested_loops(prefix, jaxpr, counter=None):
    """(path, eqn) of every loop inside a loop body, addressed as the
    walker addresses them (``_transform``): a fresh numbering per loop body
    and per jit inside a loop; branches, checkpoints and custom rules share
    their enclosing numbering."""
    counter = Counter() if counter is None else counter
    for eqn in jaxpr.eqns:
        prim = eqn.primitive
        if prim in _seam.LOOP_PRIMITIVES:
            kind = "scan" if prim is _seam.scan_p else "while"
            path = f"{prefix}/{kind}[{counter.index(kind, None)}]"
            yield path, eqn
            yield from nested_loops(path, _seam.loop_body(prim, eqn.params).jaxpr)
        elif prim is _seam.jit_p:
            sub = f"{prefix}/jit[{counter.index('jit', None)}]"
            yield from nested_loops(sub, _seam.jit_body(eqn.params).jaxpr)
        else:
            for sub in _seam.subjaxprs_of(eqn.params):
                yield from nested_loops(prefix, sub, counter)


# ------------------------------------------------------------------ reasons
def _signature(fun, ji, args, kwargs):
    """((name, type text), ...) per argument leaf, and JAX's trace context."""
    names = _arg_names(fun, len(args))
    static_nums = set(getattr(ji, "static_argnums", ()) or ())
    static_names = set(getattr(ji, "static_argnames", ()) or ())
    entries = []
    for i, a in enumerate(args):
        entries.extend(_describe(names[i], a, i in static_nums))
    for k, v in kwargs.items():
        entries.extend(_describe(k, v, k in static_names))
    return tuple(entries), _seam.monitor.trace_context()


def _arg_names(fun, n):
    try:
        params = [p for p in inspect.signature(fun).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [p.name for p in params]
    except (TypeError, ValueError):
        names = []
    return names[:n] + [f"args[{i}]" for i in range(len(names), n)]


def _describe(name, value, static):
    import jax
    if static:
        text = repr(value)
        return [(name, "static " + (text if len(text) <= 60 else text[:57] + "..."))]
    leaves = jax.tree_util.tree_flatten_with_path(value)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        return [(name, _leaf_text(leaves[0][1]))]
    if not leaves:
        return [(name, "empty pytree")]
    return [(name + jax.tree_util.keystr(p), _leaf_text(x)) for p, x in leaves]


def _leaf_text(x):
    try:
        return _seam.monitor.aval_text(_seam.abstractify(x))
    except Exception:  # noqa: BLE001
        return type(x).__name__


def _diff(new, old):
    (new_args, new_ctx), (old_args, old_ctx) = new, old
    n, o = dict(new_args), dict(old_args)
    out = [f"{k}: {n[k]} (was {o[k]})" for k in n if k in o and n[k] != o[k]]
    out += [f"{k}: {n[k]} (new)" for k in n if k not in o]
    out += [f"{k}: gone (was {o[k]})" for k in o if k not in n]
    if not _same_context(new_ctx, old_ctx):
        out.append("JAX config changed (part of every jit cache key)")
    return out


def _same_context(a, b) -> bool:
    try:
        return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))
    except Exception:  # noqa: BLE001
        return a is b


def _reason(signature, history) -> str:
    """Why a function compiled again: its difference from the closest of its
    earlier signatures in this scope."""
    if not history:
        return "first compile"
    diffs = min((_diff(signature, old) for old in reversed(history)), key=len)
    if not diffs:
        return "same arguments and config: a new function object (jit it once, outside the loop)"
    return "; ".join(diffs)


def _duration(span: Optional[tuple]) -> Optional[float]:
    return None if span is None else float(span[1] - span[0])


def make_time_taps(config, deliver) -> Optional[TimeTaps]:
    """The time taps of a configuration, or None when it asks for none."""
    c: Any = config
    if not (c.jit_events or c.trace_events or c.max_compiles is not None):
        return None
    return TimeTaps(deliver, c.jit_events, c.trace_events, c.max_compiles)
