"""The CLI's consumers: the block's counting recorder, the progress bars,
and the stderr stand-in that counts ``[tap] FAIL`` lines around the bars."""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Optional

import numpy as np

from ._collectors import FlightRecorder

FAIL_PREFIX = "[tap] FAIL "


class _Sink(FlightRecorder):
    """The block's recorder: counts events per address and streams them to
    JSONL; keeps none in memory (a long run stays small)."""

    def __init__(self, writer=None):
        super().__init__(maxlen=1)
        self.writer = writer
        self.first = None  # perf_counter() of the first event
        self.stats = {}  # (path, kind) -> [count, last step, total], first-seen order
        self.compiles = {}  # jitted function -> [compilations, seconds, last reason]
        self.timeline = None  # [(event without carry values, arrival time)] with --timeline
        self._stats_lock = threading.Lock()

    def append(self, event) -> None:
        try:
            with self._stats_lock:
                self._tally(event.path, event.kind, 1, event.step, event.total)
                if event.kind == "compile":
                    _count_compile(self.compiles, event)
                if self.timeline is not None:
                    light = event if event.kind in ("compile", "trace") else dataclasses.replace(event, value=None)
                    self.timeline.append((light, time.time()))
            if self.writer is not None:
                self.writer(event)  # JSONLWriter guards itself
        except Exception:  # noqa: BLE001 - telemetry must never disturb the script
            pass

    __call__ = append

    def append_block(self, block) -> None:
        """A buffered block: counted whole; its events only for a JSONL file."""
        try:
            n = len(block)
            if not n:
                return
            with self._stats_lock:
                self._tally(block.path, block.kind, n, int(block.steps[-1]), block.total)
                if self.timeline is not None:
                    now = time.time()
                    self.timeline.extend((dataclasses.replace(e, value=None), now) for e in block.events())
            if self.writer is not None:
                self.writer.on_block(block)
        except Exception:  # noqa: BLE001 - telemetry must never disturb the script
            pass

    def _block_appender(self):
        return self.append_block

    def _tally(self, path, kind, n, last_step, total) -> None:
        """Count ``n`` events of one address (under the stats lock)."""
        if self.first is None:
            self.first = time.perf_counter()
        s = self.stats.get((path, kind))
        if s is None:
            s = self.stats[(path, kind)] = [0, last_step, total]
        s[0] += n
        s[1], s[2] = last_step, total

    def __len__(self) -> int:
        with self._stats_lock:
            return sum(s[0] for s in self.stats.values())


class _Progress:
    """on_step consumer: one tqdm bar per outermost (depth-0) loop address.

    A loop re-run from the same source line keeps its address and restarts
    at step 0: its bar resets and counts calls in the postfix. Inside
    ``shard_map`` every shard runs the loop: a bar follows the first shard
    it hears from.
    """

    def __init__(self, tqdm_cls, stream):
        self._tqdm = tqdm_cls
        self._stream = stream
        self._bars = {}  # path -> [bar, calls]
        self._shards = {}  # path -> the shard its bar follows
        self._lock = threading.Lock()

    def _follows(self, path, shard) -> bool:
        return shard is None or self._shards.setdefault(path, shard) == shard

    def __call__(self, event) -> None:
        if "/" in event.path or event.kind != "carry" or not self._follows(event.path, event.shard):
            return
        self._at(event.path, event.total, event.step)

    def on_block(self, block) -> None:
        """A buffered block: the bar moves once per block (and restarts
        where the steps start over)."""
        if "/" in block.path or block.kind != "carry" or not len(block) or not self._follows(block.path,
                                                                                           block.origin[0]):
            return
        steps = block.steps
        ends = [int(i) for i in np.nonzero(np.diff(steps) < 0)[0]] + [len(steps) - 1]
        start = 0
        for end in ends:
            self._at(block.path, block.total, int(steps[start]))
            self._at(block.path, block.total, int(steps[end]))
            start = end + 1

    def _at(self, path, total, step) -> None:
        n = step + 1
        with self._lock:
            entry = self._bars.get(path)
            if entry is None:
                bar = self._tqdm(desc=path, total=total, file=self._stream, unit="step",
                                 dynamic_ncols=True, leave=True)
                entry = self._bars[path] = [bar, 1]
            bar = entry[0]
            if n < bar.n:  # the loop started again
                entry[1] += 1
                bar.set_postfix_str(f"call {entry[1]}", refresh=False)
                bar.reset(total=total)
            if n > bar.n:
                bar.update(n - bar.n)

    @property
    def active(self) -> bool:
        return bool(self._bars)

    def close(self, completed: bool) -> None:
        """Close every bar; `completed`: the block exited without an error,
        so every scan that started ran to its end (fill sampled bars)."""
        with self._lock:
            for bar, _ in self._bars.values():
                try:
                    if completed and bar.total is not None and bar.n < bar.total:
                        bar.update(bar.total - bar.n)
                    bar.close()
                except Exception:  # noqa: BLE001
                    pass
            self._bars.clear()


class _StderrTap:
    """Stands in for ``sys.stderr`` while the script runs: counts
    ``[tap] FAIL`` lines (also split over writes) and, while progress bars
    are shown, writes whole lines around them instead of through them.
    Everything else is delegated to the real stream."""

    def __init__(self, stream, progress: Optional[_Progress] = None, tqdm_cls=None):
        self._stream = stream
        self._progress = progress
        self._tqdm = tqdm_cls
        self._lock = threading.Lock()
        self._tail = ""
        self._partial = ""
        self.fails = 0

    def _count(self, text: str) -> None:
        with self._lock:
            data = self._tail + text
            self.fails += data.count(FAIL_PREFIX)
            self._tail = data[-(len(FAIL_PREFIX) - 1):]

    def write(self, text):
        if not isinstance(text, str):
            return self._stream.write(text)  # let the real stream raise its own TypeError
        self._count(text)
        if self._progress is None or not self._progress.active:
            with self._lock:
                pending, self._partial = self._partial, ""
            if pending:
                self._stream.write(pending)
            return self._stream.write(text)
        # line-buffer around the bars: clear them, write whole lines, redraw
        with self._lock:
            data = self._partial + text
            cut = data.rfind("\n") + 1
            lines, self._partial = data[:cut], data[cut:]
        if lines:
            with self._tqdm.external_write_mode(file=self._stream):
                self._stream.write(lines)
                self._stream.flush()
        return len(text)

    @property
    def midline(self) -> bool:
        """The last text written through this stream did not end a line."""
        return bool(self._tail) and not self._tail.endswith("\n")

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        with self._lock:
            pending, self._partial = self._partial, ""
        if pending:
            self._stream.write(pending)
        return self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _count_compile(compiles, event):
    v = event.value
    c = compiles.setdefault(event.path, [0, 0.0, ""])
    c[0] += 1
    c[1] += sum(v.get(k) or 0.0 for k in ("trace_s", "lower_s", "compile_s"))
    c[2] = v.get("reason", "")
