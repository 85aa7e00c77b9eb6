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

import collections
import inspect
import os
import re
import threading
import time
import weakref
from typing import Optional

from . import _seam
from ._event import TapEvent
from ._host import _say
from ._scope import Counter

_PHASES = {_seam.monitor.TRACE_SPAN: "trace", _seam.monitor.LOWER_SPAN: "lower",
           _seam.monitor.COMPILE_SPAN: "compile"}


class _Call:
    """One jitted function being traced, lowered and compiled."""

    __slots__ = ("path", "signature", "fun_id", "jaxpr", "spans", "cache", "transformed", "cost")

    def __init__(self, path, signature, fun_id, transformed=False):
        self.path, self.signature, self.fun_id, self.transformed = path, signature, fun_id, transformed
        self.jaxpr, self.spans, self.cache, self.cost = None, {}, "off", None


_MAX_PENDING = 64  # calls per thread awaiting their compilation (most recent kept)
_MODULE = re.compile(r"^\w+\((?P<name>.*)\)$")  # "jit(loss)": the name JAX gives a module


class TimeTaps:
    """A scope's jit-event and trace-time taps (host side).

    ``deliver(event)`` is the scope's consumer fan-out (recorder, ``on_step``,
    ``alert``). ``spans`` keeps every tracing / lowering / compiling span for
    :meth:`FlightRecorder.timeline` as ``(thread, path, phase, start, end)``
    in ``time.time()`` seconds, and each FAIL line printed as
    ``(thread, path, "alert", time, line)``.

    A compilation is matched to the jit call that asked for it by function
    name, per thread: JAX names its spans ``f`` (tracing) and ``jit(f)``
    (lowering, compiling), and lowers and compiles a call's program right
    after tracing it, or later (``.lower()`` then ``.compile()``).
    """

    def __init__(self, deliver, jit_events=False, trace_events=False, max_compiles=None):
        self.deliver = deliver
        self.jit_events = jit_events or max_compiles is not None
        self.trace_events = trace_events
        self.max_compiles = max_compiles
        self.spans: list = []  # kept across runs, as the recorder keeps its events
        self._local = threading.local()
        self._lock = threading.Lock()
        self.new_run()

    def new_run(self) -> None:
        """A new block: compile counts and reasons start over."""
        self._history: dict = {}  # path -> [(signature, function id), ...]
        self._traces: dict = {}  # loop address -> times staged
        self._promoted: dict = {}  # (file, line) -> promoted carries, not yet reported
        self._alerted: set = set()

    # ------------------------------------------------------------ jit events
    def _pending(self):
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = collections.OrderedDict()
        return pending

    def on_call(self, fun, ji, args, kwargs, clean=True):
        """A jit call (before JAX looks it up): what it is called with.
        JAX's own jits (eager operations) are remembered as such, so that
        their compilations are not reported."""
        name, file, line = _seam.monitor.jit_function_site(fun, ji)
        key = _seam.monitor.span_name(fun)
        pending = self._pending()
        if _seam.BUSY.depth or not _seam.monitor.is_user_file(file):
            call = None if file is not None or _internal(fun) else _Call(f"jit({name})", None, _ref(fun))
        else:
            site = f"@{os.path.basename(file)}:{line}" if file else ""
            call = _Call(f"jit({name}){site}", _signature(fun, ji, args, kwargs), _ref(fun), not clean)
        pending.pop(key, None)
        pending[key] = call
        while len(pending) > _MAX_PENDING:
            pending.popitem(last=False)
        if call is None:
            return None

        def after(params):
            call.jaxpr = _seam.monitor.pjit_jaxpr(params)

        return after

    def on_span(self, event, start, end, fun_name):
        phase = _PHASES.get(event)
        if phase is None or not isinstance(fun_name, str):
            return
        executable = None
        if phase == "compile":  # the executable compiled inside this span (never kept longer)
            executable, self._local.cost = getattr(self._local, "cost", None), None
        m = _MODULE.match(fun_name) if phase != "trace" else None
        name = m.group("name") if m else fun_name
        pending = self._pending()
        if name in pending:
            call = pending[name]
        elif phase == "compile":  # a program no top-level call asked for: vmap/grad of a jit
            call = _Call(f"jit({name})", None, None, transformed=True)
        else:
            return
        if call is None:
            return  # JAX's own
        call.spans[phase] = (start, end)
        with self._lock:
            self.spans.append((threading.get_ident(), call.path, phase, start, end))
        if phase == "compile":
            call.cost = None if executable is None else _seam.monitor.cost_analysis(executable)
            if pending.get(name) is call and not call.transformed:
                del pending[name]  # (a transformed call may compile several programs: grad's)
            self._compiled(call)
            call.spans = {}
        self._local.last = call

    def on_executable(self, executable):
        """A program just compiled (its compile span ends next): keep what
        XLA's cost analysis says, for the compile event."""
        self._local.cost = executable

    def on_event(self, event):
        call = getattr(self._local, "last", None)
        if call is None:
            return
        if event == _seam.monitor.CACHE_HIT:
            call.cache = "hit"
        elif event == _seam.monitor.CACHE_MISS:
            call.cache = "miss"

    def _compiled(self, call):
        if call.signature is None or call.transformed:
            n, reason = self._count(call.path, None), _TRANSFORMED
        else:
            with self._lock:
                history = self._history.setdefault(call.path, [])
                n = len(history)
                reason = _reason(call.signature, call.fun_id, history)
                history.append((call.signature, call.fun_id))
        jaxpr = call.jaxpr
        spans = call.spans
        value = {
            "trace_s": _duration(spans.get("trace")),
            "lower_s": _duration(spans.get("lower")),
            "compile_s": _duration(spans.get("compile")),
            "cache": call.cache,
            # the persistent cache keys a program by its callbacks' addresses:
            # one that holds host callbacks never hits in a new process
            "cold_in_new_process": bool(jaxpr is not None and _seam.monitor.has_host_callbacks(jaxpr)),
            "reason": reason,
            "signature": "" if call.signature is None else ", ".join(f"{k}: {v}" for k, v, _ in call.signature[0]),
            "eqns": None if jaxpr is None else _seam.monitor.count_eqns(jaxpr),
            # XLA's cost analysis: flops, transcendentals, bytes accessed (None: the backend gives none)
            "cost": call.cost,
            "start": min(a for a, _ in spans.values()),
        }
        event = TapEvent(call.path, n, value, total=None, kind="compile", process=_seam.process_tag())
        if self.max_compiles is not None and n + 1 > self.max_compiles and call.path not in self._alerted:
            self._alerted.add(call.path)
            line = f"[tap] FAIL {call.path} compiled {n + 1} times: {reason}"
            with self._lock:
                self.spans.append((threading.get_ident(), call.path, "alert", time.time(), line))
            _say(line)
        self.deliver(event)

    def _count(self, path, signature):
        with self._lock:
            history = self._history.setdefault(path, [])
            history.append((signature, None))
            return len(history) - 1

    # ---------------------------------------------------------- trace events
    def on_promotion(self):
        site = _seam.current_site()
        key = tuple(site[:2])
        with self._lock:
            self._promoted[key] = self._promoted.get(key, 0) + 1

    def on_loop(self, path, prim, params, site):
        """A top-level loop staged at ``path`` (and the loops inside it, at
        theirs); ``path`` None: a loop in a custom rule's body (no event).
        Promotions pending now happened while JAX traced this loop: what
        its reports do not claim is dropped."""
        try:
            if path is not None:
                self._report(path, prim, params, site)
                for sub_path, eqn in nested_loops(path, _seam.loop_body(prim, params).jaxpr):
                    self._report(sub_path, eqn.primitive, eqn.params, _seam.site_of_eqn(eqn))
        finally:
            with self._lock:
                self._promoted.clear()

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
        self.deliver(TapEvent(path, n, value, total=None, kind="trace", process=_seam.process_tag()))


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
_TRANSFORMED = ("a transformed program (vmap, grad or pmap of a jitted function, or compiled ahead of time): "
                "no top-level call to compare")
_NEW_FUNCTION = "same arguments and config: a new function object (jit it once, outside the loop)"
_UNEXPLAINED = ("same function, arguments and config as before: JAX's cache missed for what types do not show "
                "(committed vs uncommitted arrays, shardings, or its caches were cleared)")


def _internal(fun) -> bool:
    return str(getattr(fun, "__module__", "") or "").startswith(("jax.", "jaxlib", "jaxtap"))


def _signature(fun, ji, args, kwargs):
    """((name, type text, key), ...) per argument leaf, and JAX's trace
    context. ``key`` decides equality (a static value itself, not its repr)."""
    names = _arg_names(fun, len(args))
    static_nums = set(getattr(ji, "static_argnums", ()) or ())
    static_names = set(getattr(ji, "static_argnames", ()) or ())
    entries = []
    for i, a in enumerate(args):
        entries.extend(_describe(names[i], a, i in static_nums))
    for k, v in kwargs.items():
        entries.extend((n, t + " by keyword", (key, "by keyword")) for n, t, key in _describe(k, v, k in static_names))
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
        try:
            key = ("static", hash(value), value)
        except TypeError:
            key = ("static", text)
        return [(name, "static " + (text if len(text) <= 60 else text[:57] + "..."), key)]
    leaves = jax.tree_util.tree_flatten_with_path(value)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        text = _leaf_text(leaves[0][1])
        return [(name, text, text)]
    if not leaves:
        return [(name, "empty pytree", "empty pytree")]
    return [(name + jax.tree_util.keystr(p), t, t) for p, t in ((p, _leaf_text(x)) for p, x in leaves)]


def _leaf_text(x):
    try:
        return _seam.monitor.aval_text(_seam.abstractify(x))
    except Exception:  # noqa: BLE001
        return type(x).__name__


def _same_key(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an array-valued static argument
        return a is b


def _diff(new, old):
    (new_args, new_ctx), (old_args, old_ctx) = new, old
    n = {k: (t, key) for k, t, key in new_args}
    o = {k: (t, key) for k, t, key in old_args}
    out = []
    for k, (t, key) in n.items():
        if k not in o:
            out.append(f"{k}: {t} (new)")
        elif not _same_key(key, o[k][1]):
            was = o[k][0]
            out.append(f"{k}: {t} (was {was})" if t != was else f"{k}: a different static value ({t})")
    out += [f"{k}: gone (was {t})" for k, (t, _) in o.items() if k not in n]
    if not _same_context(new_ctx, old_ctx):
        out.append("JAX config changed (part of every jit cache key)")
    return out


def _same_context(a, b) -> bool:
    try:
        return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))
    except Exception:  # noqa: BLE001
        return a is b


def _reason(signature, fun_id, history) -> str:
    """Why a function compiled (again): its difference from the closest of
    its earlier signatures in this scope."""
    if not history:
        return "first compile in this scope"
    diffs, old_fun = min(((_diff(signature, old), f) for old, f in reversed(history) if old is not None),
                         key=lambda d: len(d[0]), default=(None, None))
    if diffs is None:
        return _TRANSFORMED
    if diffs:
        return "; ".join(diffs)
    return _UNEXPLAINED if old_fun is not None and old_fun() is not None and old_fun() is fun_id() else _NEW_FUNCTION


def _ref(fun):
    """A reference to a jitted function that does not keep it alive."""
    try:
        return weakref.ref(fun)
    except TypeError:
        return lambda: fun


def _duration(span: Optional[tuple]) -> Optional[float]:
    return None if span is None else float(span[1] - span[0])


def make_time_taps(config, deliver) -> Optional[TimeTaps]:
    """The time taps of a configuration, or None when it asks for none."""
    if not config.time_taps:
        return None
    return TimeTaps(deliver, config.jit_events, config.trace_events, config.max_compiles)


class Signals:
    """Routes JAX's compile-time signals to the time taps of the scope this
    thread's work belongs to (``scope_here()``: that scope, or None)."""

    def __init__(self, scope_here):
        self._here = scope_here

    def _times(self, jit=True):
        ctx = self._here()
        times = None if ctx is None else getattr(ctx, "_times", None)
        return times if times is not None and (times.jit_events if jit else times.trace_events) else None

    def jit_call(self, fun, ji, args, kwargs, clean=True):
        times = self._times()
        return None if times is None else times.on_call(fun, ji, args, kwargs, clean)

    def span(self, event, start, end, fun_name):
        times = self._times()
        if times is not None:
            times.on_span(event, start, end, fun_name)

    def executable(self, executable):
        times = self._times()
        if times is not None:
            times.on_executable(executable)

    def cache_event(self, event):
        times = self._times()
        if times is not None:
            times.on_event(event)

    def promotion(self):
        times = self._times(jit=False)
        if times is not None:
            times.on_promotion()
