"""`python -m jaxtap`: the zero-edit command line (each test runs one subprocess)."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import jaxtap as tap

# A scan of 20 steps whose log(0) at step 1 gives the first -inf, then a
# while loop of 7 steps. Flags (after the script path) choose how it ends.
SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp

    def f(c0, xs):
        return jax.lax.scan(lambda c, x: (c + jnp.log(x), c), c0, xs)

    xs = jnp.array([1.0, 0.0] + [2.0] * 18)
    c, _ = jax.jit(f)(jnp.float32(0.0), xs)
    n = jax.lax.while_loop(lambda i: i < 7, lambda i: i + 1, 0)
    print("argv", json.dumps(sys.argv), "path0", sys.path[0], flush=True)
    print("result", float(c), int(n), flush=True)
    print("script's own stderr", file=sys.stderr)
    if "--exit3" in sys.argv:
        sys.exit(3)
    if "--raise" in sys.argv:
        raise ValueError("boom from the script")
""")

SUMMARY_ROW = re.compile(r"^\s+(\S+)\s+(carry|primitive|output)\s+(\d+)\s+\S+$", re.M)


@pytest.fixture
def script(tmp_path):
    d = tmp_path / "proj"
    d.mkdir()
    path = d / "train.py"
    path.write_text(SCRIPT)
    return path


def run_cli(cwd, *args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_ENABLE_X64", None)
    return subprocess.run([sys.executable, "-m", "jaxtap", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def summary_rows(stderr):
    return {(path, kind): int(n) for path, kind, n in SUMMARY_ROW.findall(stderr)}


def test_help_lists_every_option(tmp_path):
    r = run_cli(tmp_path, "--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--progress", "--watch-nan [PRIM]", "--print PRIM", "--sample-every N", "--max-depth N",
                "--jsonl FILE", "--no-values", "--flush-every K", "--summary", "--version", "script",
                "examples:"):
        assert opt in r.stdout, opt


def test_summary_and_jsonl(script, tmp_path):
    out = tmp_path / "f.jsonl"
    r = run_cli(tmp_path, "--summary", "--jsonl", out, script)
    assert r.returncode == 0, r.stderr
    assert "result -inf 7" in r.stdout and "script's own stderr" in r.stderr
    assert summary_rows(r.stderr) == {("scan[0]", "carry"): 20, ("while[0]", "carry"): 7}
    assert "alerts fired ([tap] FAIL lines): 0" in r.stderr
    assert "time to first event:" in r.stderr and "first event to end:" in r.stderr
    events = tap.read_jsonl(out)
    scan = [e for e in events if e.path == "scan[0]"]
    assert [e.step for e in scan] == list(range(20)) and {e.total for e in scan} == {20}
    assert float(scan[0].value[0]) == 0.0 and scan[-1].value[0] == -float("inf")  # select=None: every leaf
    assert [e.step for e in events if e.path == "while[0]"] == list(range(7))


def test_flush_every_records_the_same_events(script, tmp_path):
    plain, buffered = tmp_path / "plain.jsonl", tmp_path / "buffered.jsonl"
    for out, extra in ((plain, ()), (buffered, ("--flush-every", "6"))):
        r = run_cli(tmp_path, "--jsonl", out, "--print", "log", *extra, script)
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("[tap] scan[0]/log[0]") == 20
    key = lambda e: (e.path, e.step, e.kind, repr(e.value))  # noqa: E731
    assert sorted(map(key, tap.read_jsonl(buffered))) == sorted(map(key, tap.read_jsonl(plain)))


def test_watch_nan_named_primitive(script, tmp_path):
    r = run_cli(tmp_path, "--watch-nan", "log", "--summary", script)
    assert r.returncode == 0, r.stderr
    fails = [line for line in r.stderr.splitlines() if line.startswith("[tap] FAIL")]
    assert fails == ["[tap] FAIL scan[0]/log[0] 1/20: NaN/Inf"]
    assert "alerts fired ([tap] FAIL lines): 1" in r.stderr
    assert summary_rows(r.stderr)[("scan[0]/log[0]", "primitive")] == 1


def test_watch_nan_alone_reports_birth_site(script, tmp_path):
    r = run_cli(tmp_path, "--watch-nan", script)  # the script path is not taken as PRIM
    assert r.returncode == 0, r.stderr
    assert "[tap] FAIL scan[0]/log[0] 1/20: NaN/Inf born here (inputs finite)" in r.stderr
    assert "[jax-tap] summary" not in r.stderr  # an observation option given: no implied summary


def test_print_primitive(script, tmp_path):
    r = run_cli(tmp_path, "--print=log", script)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("[tap] scan[0]/log[0]")]
    assert len(lines) == 20 and lines[1] == "[tap] scan[0]/log[0] 1/20: array([-inf], dtype=float32)"


def test_script_args_and_sys_path_pass_through(script, tmp_path):
    r = run_cli(tmp_path, "--summary", script, "--lr", "0.1", "--summary", "-x")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("argv "))
    argv, path0 = line[len("argv "):].split(" path0 ")
    assert json.loads(argv) == [str(script), "--lr", "0.1", "--summary", "-x"]
    assert os.path.realpath(path0) == os.path.realpath(script.parent)


def test_script_exit_code_preserved(script, tmp_path):
    r = run_cli(tmp_path, "--summary", script, "--exit3")
    assert r.returncode == 3, r.stderr
    assert "result -inf 7" in r.stdout and "exit code 3" in r.stderr


def test_raising_script_traceback_and_outputs(script, tmp_path):
    out = tmp_path / "f.jsonl"
    r = run_cli(tmp_path, "--summary", "--jsonl", out, script, "--raise")
    assert r.returncode == 1
    assert "Traceback (most recent call last):" in r.stderr
    assert "ValueError: boom from the script" in r.stderr
    assert f'File "{script}", line' in r.stderr and "runpy" not in r.stderr and "_cli.py" not in r.stderr
    assert "raised ValueError, exit code 1" in r.stderr
    assert summary_rows(r.stderr)[("scan[0]", "carry")] == 20
    assert len(tap.read_jsonl(out)) == 27


def test_progress_bars(script, tmp_path):
    pytest.importorskip("tqdm")
    r = run_cli(tmp_path, "--progress", script)
    assert r.returncode == 0, r.stderr
    assert "result -inf 7" in r.stdout
    assert re.search(r"scan\[0\]: 100%\|.*\| 20/20", r.stderr), r.stderr
    assert re.search(r"while\[0\]: 7step", r.stderr), r.stderr


def test_progress_bars_count_carries_only_beside_a_primitive_tap(script, tmp_path):
    # primitive events reach on_step too (0.3.1); the bars filter by kind
    pytest.importorskip("tqdm")
    r = run_cli(tmp_path, "--progress", "--print", "log", script)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("[tap] scan[0]/log[0] ") == 20
    assert re.search(r"scan\[0\]: 100%\|.*\| 20/20", r.stderr), r.stderr
    assert not re.search(r"scan\[0\]/log\[0\]: ", r.stderr), r.stderr  # no bar for the primitive


def test_sample_every_reduces_events(script, tmp_path):
    out = tmp_path / "f.jsonl"
    r = run_cli(tmp_path, "--sample-every", "10", "--jsonl", out, script)
    assert r.returncode == 0, r.stderr
    events = tap.read_jsonl(out)
    assert [(e.path, e.step) for e in events] == [("scan[0]", 0), ("scan[0]", 10), ("while[0]", 0)]


@pytest.mark.parametrize("args, message", [
    (["missing.py"], "can't open file 'missing.py'"),
    (["--sample-every", "0", "train.py"], "--sample-every: must be a positive integer"),
    (["--max-depth", "-1", "train.py"], "--max-depth: must be an integer >= 0"),
    (["--summary"], "no script given"),
    (["--jsonl", "train.py", "train.py"], "--jsonl 'train.py' is the script itself"),
    (["--timeline", "./train.py", "train.py"], "--timeline './train.py' is the script itself"),
    (["--jsonl", "o.json", "--timeline", "o.json", "train.py"], "name the same file 'o.json'"),
])
def test_bad_input_exits_2_before_running(script, args, message):
    before = script.read_text()
    r = run_cli(script.parent, *args)
    assert r.returncode == 2
    assert message in r.stderr and "usage: python -m jaxtap" in r.stderr
    assert "result" not in r.stdout
    assert script.read_text() == before and not (script.parent / "o.json").exists()


def test_ctrl_c_stops_the_run_with_exit_130(tmp_path):
    # a real SIGINT while the tapped loop runs: on CPU the hop runs on the
    # thread that waits for the program, so the interrupt lands in jax-tap's
    # host code; it must stop the run (not be swallowed as a consumer failure)
    (tmp_path / "long.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp
        f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (jnp.sin(c) * 0.999 + 1.0, None), x, None,
                                           length=100_000_000)[0])
        f(jnp.ones(8)).block_until_ready()
        print("the loop ran to its end")
    """))
    out = tmp_path / "run.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "jaxtap", "--jsonl", str(out), "--no-values", "--summary",
                             "long.py"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.stat().st_size > 0) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until events stream: the loop runs
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "the loop ran to its end" not in stdout
    assert "raised KeyboardInterrupt, exit code 130" in stderr
    assert 0 < len(out.read_text().splitlines()) < 100_000_000


def test_an_output_that_is_the_script_by_a_hard_link_is_refused(script):
    # helper-46: the first check compared real paths, which a hard link passes
    import os

    link = script.parent / "linked.jsonl"
    os.link(script, link)
    before = script.read_text()
    r = run_cli(script.parent, "--jsonl", "linked.jsonl", "train.py")
    assert r.returncode == 2 and "is the script itself" in r.stderr
    assert script.read_text() == before
