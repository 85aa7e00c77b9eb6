"""A recorded run as a Chrome trace-event JSON file (Perfetto UI,
``chrome://tracing``): ``FlightRecorder.timeline(path)`` and the CLI's
``--timeline FILE``.

Tracks: one per thread that traced, lowered or compiled (complete ``"X"``
spans per jitted function), one counter track per loop address (its step,
by arrival time), instants for trace, compile and primitive events, and
global markers for ``max_compiles`` FAIL lines.
Timestamps are microseconds since the first thing recorded; every track is
written in time order.
"""
from __future__ import annotations

import json
import threading
from typing import List

_PID = 1
_EVENTS_TID = 0  # the track of instants (events arrive on JAX's callback threads)
_MAX_POINTS = 20_000  # counter samples per loop address (a long run is thinned evenly)


def _instant(e, ts):
    args = {"step": int(e.step)}
    if e.kind in ("compile", "trace") and isinstance(e.value, dict):
        args.update({k: v for k, v in e.value.items() if isinstance(v, (int, float, str, bool, list, type(None)))})
    return {"name": f"{e.kind} {e.path}", "cat": e.kind, "ph": "i", "s": "t", "ts": ts,
            "pid": _PID, "tid": _EVENTS_TID, "args": args}


def build_timeline(events, times, spans) -> List[dict]:
    """The trace events (dicts) of a run: ``events``/``times`` as a
    recorder keeps them, ``spans`` as :class:`_timetaps.TimeTaps` does."""
    stamps = [t for t in times if t is not None] + [s[3] for s in spans]
    alerts = [s for s in spans if s[2] == "alert"]
    spans = [s for s in spans if s[2] != "alert"]
    for e in events:
        if e.kind == "compile" and isinstance(e.value, dict) and e.value.get("start"):
            stamps.append(e.value["start"])
    t0 = min(stamps) if stamps else 0.0

    def us(t):
        return round((t - t0) * 1e6, 3)

    out, threads = [], {}
    for thread, path, phase, start, end in spans:
        tid = threads.setdefault(thread, len(threads) + 1)
        out.append({"name": f"{phase} {path}", "cat": "jit", "ph": "X", "ts": us(start),
                    "dur": max(0.0, round((end - start) * 1e6, 3)), "pid": _PID, "tid": tid,
                    "args": {"function": path, "phase": phase}})
    for thread, path, _, t, line in alerts:  # markers across every track
        out.append({"name": line, "cat": "alert", "ph": "i", "s": "g", "ts": us(t), "pid": _PID,
                    "tid": threads.setdefault(thread, len(threads) + 1), "args": {"function": path}})
    by_path: dict = {}
    for e, t in zip(events, times):
        if t is None:
            continue
        if e.kind in ("carry", "output"):
            by_path.setdefault(e.path, []).append((t, e.step))
        else:
            out.append(_instant(e, us(t)))
    for path, points in by_path.items():
        stride = max(1, len(points) // _MAX_POINTS)
        for t, step in points[::stride]:
            out.append({"name": path, "cat": "loop", "ph": "C", "ts": us(t), "pid": _PID, "tid": _EVENTS_TID,
                        "args": {"step": int(step)}})
    out.sort(key=lambda d: d["ts"])
    meta = [{"name": "process_name", "ph": "M", "pid": _PID, "tid": 0, "ts": 0, "args": {"name": "jax-tap run"}},
            {"name": "thread_name", "ph": "M", "pid": _PID, "tid": _EVENTS_TID, "ts": 0,
             "args": {"name": "events (host callbacks)"}}]
    main = threading.main_thread().ident
    for thread, tid in threads.items():
        name = "main thread" if thread == main else f"thread {thread}"
        meta.append({"name": "thread_name", "ph": "M", "pid": _PID, "tid": tid, "ts": 0,
                     "args": {"name": f"{name}: trace / lower / compile"}})
    return meta + out


def write_timeline(path, events, times, spans) -> None:
    """Write :func:`build_timeline` to ``path`` as ``{"traceEvents": [...]}``."""
    doc = {"traceEvents": build_timeline(events, times, spans), "displayTimeUnit": "ms"}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, default=_plain)


def _plain(x):
    """numpy scalars and arrays in an event's value, as JSON can hold them."""
    try:
        return x.tolist()
    except AttributeError:
        return repr(x)
