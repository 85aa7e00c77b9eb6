"""``python -m jaxtap``: run an unmodified script under ``tap.record()``.

Like ``python -m cProfile``: the script runs as ``__main__`` (``runpy``) with
``sys.argv = [script, *args]`` and ``sys.path[0]`` set to its directory,
inside one ``with tap.record(...)`` block configured from the options. The
script's own output, exit code and traceback are left as Python would give
them; the CLI adds only its options' output (``[tap]`` lines, progress bars,
the summary) on stderr and the JSONL file.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import time

from ._cli_consumers import _Progress, _Sink, _StderrTap
from ._host import _say
from . import _seam
from ._version import __version__

PROG = "python -m jaxtap"
DEMO_EXTRA = 'pip install "jax-tap[demo]"'

DESCRIPTION = """\
Run an unmodified Python script under jax-tap: every lax.scan / while_loop it
executes (fori_loop, lax.map and library loops included) is observed live,
and the program computes exactly what it computes without jax-tap.

Options go before the script; everything after the script path is passed to
the script untouched (sys.argv = [script, *args]). With no observation option
(--progress, --watch-nan, --print, --jsonl), --summary is implied."""

EPILOG = """\
examples:
  python -m jaxtap --progress train.py --lr 0.1
      a live progress bar per outermost loop; --lr 0.1 goes to train.py
  python -m jaxtap --watch-nan solve.py
      report where the first NaN/Inf is born (primitive, address, step)
  python -m jaxtap --watch-nan log --print cholesky solve.py
      alert on non-finite log outputs, print every cholesky output
  python -m jaxtap --summary --jsonl run.jsonl --sample-every 10 sim.py
      stream every 10th step to run.jsonl (read it with tap.read_jsonl),
      then print events per address, alerts and the compile/execute split
  python -m jaxtap --jit-events --max-compiles 2 --timeline run.trace.json train.py
      report every compilation (and why a function recompiled), FAIL when one
      compiles a third time, and write a timeline for Perfetto UI

notes:
  --watch-nan takes PRIM only when the next word looks like a primitive name
  (letters, digits, _) and is not the script; write --watch-nan=PRIM to be
  explicit, or put `--` before the script path.
  jax is imported before the script runs: set JAX_* environment variables
  (JAX_PLATFORMS, JAX_ENABLE_X64, ...) in the shell, or use
  jax.config.update() in the script, not os.environ inside the script.
  Exit status: the script's own; 1 if it raised; 2 for bad options."""

# options that always take a value / that may take one (see _split_argv)
_VALUE_OPTS = {"--print", "--sample-every", "--max-depth", "--jsonl", "--flush-every", "--max-compiles", "--timeline"}
_OPTIONAL_VALUE_OPTS = {"--watch-nan"}
_PRIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ------------------------------------------------------------------ parsing
def _at_least_one(meaning: str):
    """An argparse type: an int >= 1; ``meaning`` says what 1 means."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive integer ({meaning}), got {text!r}")
        return value

    return parse


_positive_int = _at_least_one("1 = every step")
_compile_count = _at_least_one("compilations allowed per function")


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0 = outermost loops only), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--progress", action="store_true",
                   help="show a live tqdm bar per outermost loop (a known total for scans, a running "
                        "count for while loops); needs tqdm (" + DEMO_EXTRA + ")")
    p.add_argument("--watch-nan", metavar="PRIM", nargs="?", action="append", const=None,
                   help="alert live ([tap] FAIL lines) when PRIM's output is not finite; without PRIM, "
                        "report the NaN/Inf birth site (the first equation whose inputs are finite and "
                        "output is not). Repeatable")
    p.add_argument("--print", metavar="PRIM", action="append", dest="print",
                   help="print every output of primitive PRIM as it happens ([tap] lines). Repeatable")
    p.add_argument("--sample-every", metavar="N", type=_positive_int, default=1,
                   help="observe only steps whose index is a multiple of N (gated on device; "
                        "also applies to --watch-nan/--print inside loops). Default 1")
    p.add_argument("--flush-every", metavar="K", type=_positive_int, default=None,
                   help="buffer K sampled steps on the device and ship them in one host hop "
                        "(every step recorded at a fraction of the cost; events arrive K at a time)")
    p.add_argument("--max-depth", metavar="N", type=_nonneg_int, default=None,
                   help="observe loop carries only down to nesting depth N (0 = outermost loops); "
                        "primitive taps are not limited")
    p.add_argument("--jsonl", metavar="FILE",
                   help="stream every event (loop carries and primitive taps) to FILE as JSON lines, "
                        "flushed per line; the file is overwritten. Read it with tap.read_jsonl(FILE)")
    p.add_argument("--no-values", action="store_true",
                   help="with --jsonl, record only path/step/total of loop events instead of every "
                        "carry leaf (much less data for big carries)")
    p.add_argument("--jit-events", action="store_true",
                   help="record one event per compilation of a jitted function (tracing / lowering / "
                        "compiling seconds, and why it recompiled); the summary lists them")
    p.add_argument("--max-compiles", metavar="N", type=_compile_count, default=None,
                   help="print a [tap] FAIL line the moment a jitted function compiles more than N times, "
                        "with the reason (implies --jit-events)")
    p.add_argument("--per-shard", action="store_true",
                   help="under a sharded jit whose arrays carry their sharding in their types (explicit mesh "
                        "axes), ship each shard's piece from its own device instead of gathering it to one "
                        "(events tagged with their shard); inside shard_map events are per shard anyway")
    p.add_argument("--backward", action="store_true",
                   help="cotangent taps: a scan's backward loop (under jax.grad) reports at the forward loop's "
                        "address, kind 'cotangent', step = the forward step; --watch-nan names NaN/Inf born in "
                        "the backward pass as such")
    p.add_argument("--trace-events", action="store_true",
                   help="record one event per loop each time JAX traces it (carry types, weak-type "
                        "promotion, body size); adds nothing to the compiled program")
    p.add_argument("--timeline", metavar="FILE",
                   help="write the run as a Chrome trace-event JSON file (open it in Perfetto UI or "
                        "chrome://tracing): compile spans, loop progress, events (implies --jit-events)")
    p.add_argument("--summary", action="store_true",
                   help="at the end, print to stderr: events per address (count, kind, last step), "
                        "alerts fired, and the time to the first event (start-up, tracing, compilation) "
                        "vs from the first event to the end (execution)")
    p.add_argument("--version", action="version", version=f"%(prog)s (jax-tap {__version__})")
    p.add_argument("script", help="path of the Python script to run (as __main__)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script untouched")
    return p


def _looks_like_prim(word: str, is_last: bool) -> bool:
    """Is `word`, right after a bare --watch-nan, its PRIM (not the script)?"""
    if is_last or not _PRIM_NAME.match(word):
        return False  # the script is required, so the last word is the script
    if os.path.isfile(word):
        return _seam.primitive_named(word) is not None
    return True


def _split_argv(argv):
    """Split argv into (options, script or None, script args): option parsing
    stops at the first word that is not an option or an option's value."""
    opts, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            rest = argv[i + 1:]
            return opts, (rest[0] if rest else None), rest[1:]
        if word.startswith("-") and word != "-":
            opts.append(word)
            name, eq, _ = word.partition("=")
            if not eq and i + 1 < len(argv):
                nxt = argv[i + 1]
                if name in _VALUE_OPTS or (name in _OPTIONAL_VALUE_OPTS
                                           and _looks_like_prim(nxt, is_last=i + 2 == len(argv))):
                    opts.append(nxt)
                    i += 1
            i += 1
            continue
        return opts, word, argv[i + 1:]
    return opts, None, []


def parse_args(argv):
    parser = build_parser()
    opts, script, script_args = _split_argv(list(argv))
    ns = parser.parse_args(opts + ["--", "" if script is None else script])  # -h, --version exit here
    if script is None:
        parser.error("no script given: python -m jaxtap [options] script.py [script args]")
    ns.args = list(script_args)
    return parser, ns


def _no_loops(path):  # `where` when no option needs loop carries
    return False


def _steps_only(leaves):  # `select`: only path/step/total cross to the host
    return ()


# ------------------------------------------------------------------ summary
def _covered(spans) -> float:
    """Seconds covered by the union of (start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted((s[3], s[4]) for s in spans if s[2] != "alert"):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def _format_summary(script, sink, fails, t0, t_end, outcome, spans=()) -> str:
    lines = [f"[jax-tap] summary: {script} ({outcome})"]
    if sink.stats:
        rows = [(path, kind, str(c), f"{step}/{'?' if total is None else total}")
                for (path, kind), (c, step, total) in sink.stats.items()]
        head = ("address", "kind", "events", "last step")
        w = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
        lines.append(f"  {head[0]:<{w[0]}}  {head[1]:<{w[1]}}  {head[2]:>{w[2]}}  {head[3]}")
        for r in rows:
            lines.append(f"  {r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]}")
        lines.append(f"  events: {len(sink)} at {len(sink.stats)} addresses")
    else:
        lines.append("  no events: no tapped loop or primitive ran inside the block "
                     "(work on other threads is not tapped)")
    lines.append(f"  alerts fired ([tap] FAIL lines): {fails}")
    total = t_end - t0
    if sink.compiles:
        jit_s = _covered(spans)  # wall time with some tracing/lowering/compiling on (threads overlap)
        n = sum(c[0] for c in sink.compiles.values())
        lines.append(f"  compilations: {n} of {len(sink.compiles)} jitted functions")
        for path, (count, secs, reason) in sorted(sink.compiles.items(), key=lambda kv: -kv[1][1])[:10]:
            why = f"  last: {reason}" if count > 1 else ""
            lines.append(f"    {path}  x{count}  {secs:.3f} s{why}")
        lines.append(f"  tracing+lowering+compiling: {jit_s:9.3f} s  (wall time covered by compile spans)")
        lines.append(f"  everything else:            {total - jit_s:9.3f} s  (execution, Python, start-up)")
    elif sink.first is not None:
        lines.append(f"  time to first event: {sink.first - t0:9.3f} s  (start-up, tracing, compilation)")
        lines.append(f"  first event to end:  {t_end - sink.first:9.3f} s  (execution)")
    lines.append(f"  total:               {total:9.3f} s")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ running
def _script_traceback(tb):
    """Drop the leading frames of this module and runpy, which Python's own
    traceback of ``python script.py`` does not show."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return tb


def _print_exception(exc, tb) -> None:
    exc.__traceback__ = tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # noqa: BLE001 - a broken hook: print as Python's default would
        import traceback
        traceback.print_exception(type(exc), exc, tb)


def main(argv=None) -> int:
    """Entry point of ``python -m jaxtap``; returns the exit status (the
    script's own SystemExit code is returned unchanged)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, ns = parse_args(argv)
    # validate everything before running anything (exit 2)
    _check_script(parser, ns.script)
    _check_outputs(parser, ns)
    if not (ns.progress or ns.watch_nan or ns.print or ns.jsonl or ns.summary or ns.timeline):
        ns.summary = True
    tqdm_cls = None
    if ns.progress:
        try:
            from tqdm import tqdm as tqdm_cls
        except ImportError:
            parser.error(f"--progress needs tqdm, which is not installed: {DEMO_EXTRA}")
    real_stderr = sys.stderr
    progress = _Progress(tqdm_cls, real_stderr) if ns.progress else None
    block, sink, writer = _make_block(parser, ns, progress)
    err_tap = _StderrTap(real_stderr, progress, tqdm_cls) if real_stderr is not None else None
    error, code, t0, t_end = _run_script(ns, block, progress, err_tap, real_stderr, writer)
    if error is not None:
        _print_exception(error, _script_traceback(error.__traceback__))
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
    if ns.summary:
        _report(ns.script, sink, err_tap, real_stderr, t0, t_end, error, code,
                block._times.spans if block._times is not None else ())
    if ns.timeline:
        _write_timeline(ns.timeline, sink, block, real_stderr)
    return code


def _write_timeline(path, sink, block, stream) -> None:
    from ._timeline import write_timeline
    rows = sink.timeline or []
    spans = block._times.spans if block._times is not None else []
    try:
        write_timeline(path, [e for e, _ in rows], [t for _, t in rows], spans)
    except Exception as exc:  # noqa: BLE001 - the script already ran; say why there is no file
        _say(f"[jax-tap] --timeline: could not write {path!r}: {exc}", stream)


def _check_script(parser, script) -> None:
    if not os.path.exists(script):
        parser.error(f"can't open file {script!r}: no such file or directory")
    if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        parser.error(f"can't find '__main__.py' in directory {script!r}")
    if os.path.isfile(script):
        try:
            open(script, "rb").close()
        except OSError as exc:
            parser.error(f"can't open file {script!r}: {exc.strerror}")


def _check_outputs(parser, ns) -> None:
    """An output file that is the script (or the other output) would be
    overwritten: refuse before anything is written."""
    outputs = [(flag, path) for flag, path in (("--jsonl", ns.jsonl), ("--timeline", ns.timeline)) if path]
    for i, (flag, path) in enumerate(outputs):
        if _same_file(path, ns.script):
            parser.error(f"{flag} {path!r} is the script itself, which it would overwrite; name another file")
        if any(_same_file(path, other) for _, other in outputs[:i]):
            parser.error(f"--jsonl and --timeline name the same file {path!r}; name two files")


def _same_file(a, b) -> bool:
    """One file by two names (links included, when both exist)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet
        return os.path.realpath(a) == os.path.realpath(b)


def _make_block(parser, ns, progress):
    """The script's with-block, its counting recorder and its JSONL writer."""
    import jaxtap as tap

    taps = []
    try:
        taps += [tap.watch_nan(prim) for prim in (ns.watch_nan or [])]
        taps += [tap.print(prim) for prim in (ns.print or [])]
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    wants_carry = ns.progress or ns.summary or bool(ns.jsonl) or bool(ns.timeline)
    max_depth = ns.max_depth
    if ns.progress and not (ns.summary or ns.jsonl) and max_depth is None:
        max_depth = 0  # bars need the outermost loops only
    cfg = dict(taps=taps, sample_every=ns.sample_every, max_depth=max_depth, flush_every=ns.flush_every,
               select=None if (ns.jsonl and not ns.no_values) else _steps_only,
               jit_events=ns.jit_events or bool(ns.timeline), trace_events=ns.trace_events,
               max_compiles=ns.max_compiles, timeline=bool(ns.timeline), per_shard=ns.per_shard,
               backward=ns.backward)
    if not wants_carry:
        cfg["where"] = _no_loops
    if progress is not None:
        cfg["on_step"] = progress
    writer = None
    if ns.jsonl:
        try:
            open(ns.jsonl, "w", encoding="utf-8").close()  # overwrite; fail here, not mid-run
        except OSError as exc:
            parser.error(f"--jsonl: can't write {ns.jsonl!r}: {exc.strerror or exc}")
        writer = tap.JSONLWriter(ns.jsonl, overwrite=True)  # per process under jax.distributed
    sink = _Sink(writer)
    if ns.timeline:
        try:
            open(ns.timeline, "w", encoding="utf-8").close()  # fail here, not after the run
        except OSError as exc:
            parser.error(f"--timeline: can't write {ns.timeline!r}: {exc.strerror or exc}")
        sink.timeline = []
    try:
        return tap.TapContext(recorder=sink, **cfg), sink, writer
    except (TypeError, ValueError) as exc:
        if writer is not None:
            writer.close()
        parser.error(str(exc))


def _run_script(ns, block, progress, err_tap, real_stderr, writer):
    """Run the script as ``__main__`` inside the block, like ``python script.py``.
    Returns (the exception it raised or None, its exit code, start, end)."""
    script = ns.script
    sys.argv = [script, *ns.args]
    if not sys.flags.safe_path:
        # a file: its directory, as `python script.py` does; a directory or zip: itself
        where = os.path.dirname(os.path.realpath(script)) if os.path.isfile(script) else script
        if sys.path:
            sys.path[0] = where
        else:
            sys.path.insert(0, where)
    if err_tap is not None:
        sys.stderr = err_tap
    error, code = None, 0  # an exception the script raised (not SystemExit)
    t0 = time.perf_counter()
    try:
        try:
            with block:
                runpy.run_path(os.path.abspath(script), run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # noqa: BLE001 - reported as Python would, by main
            error = exc
    finally:
        t_end = time.perf_counter()
        if progress is not None:
            progress.close(completed=error is None)
        if err_tap is not None:
            try:
                err_tap.flush()
            except Exception:  # noqa: BLE001
                pass
            if sys.stderr is err_tap:
                sys.stderr = real_stderr
        if writer is not None:
            writer.close()
    return error, code, t0, t_end


def _report(script, sink, err_tap, real_stderr, t0, t_end, error, code, spans=()) -> None:
    """The --summary table, on the real stderr."""
    if error is not None:
        outcome = f"raised {type(error).__name__}, exit code {code}"
    elif code is None or isinstance(code, int):
        outcome = f"exit code {int(code or 0)}"
    else:
        outcome = "exit code 1"  # SystemExit("message")
    fails = err_tap.fails if err_tap is not None else 0
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    text = _format_summary(script, sink, fails, t0, t_end, outcome, spans)
    if err_tap is not None and err_tap.midline:
        text = "\n" + text  # the script left stderr mid-line
    _say(text, real_stderr if real_stderr is not None else sys.__stderr__, end="")
