"""JSONL telemetry files: crash-safe reading, clear errors, streaming, 0.3.1 files.

Faults tried: a final line cut mid-write, a child killed with SIGKILL while
streaming, a disk that fills up mid-run (ENOSPC, after half a line), garbage
and random byte corruption, wrong shapes and dtypes, and a KeyboardInterrupt
raised while a buffered block is being delivered.
"""
from __future__ import annotations

import collections
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxtap as tap
from jaxtap import _seam
from taputil import assert_bits, sync


def write_events(path, n, width=3):
    with tap.JSONLWriter(str(path)) as out:
        for i in range(n):
            out(tap.TapEvent("scan[0]", i, (np.arange(width, dtype=np.float32) + i,), n))
    return str(path)


def tap_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, tap.TapWarning)]


# ------------------------------------------------------------ cut and corrupt
def test_a_cut_final_line_is_dropped_with_one_warning_naming_it(tmp_path):
    path = write_events(tmp_path / "run.jsonl", 5, width=50)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 100])  # the 5th line loses its end
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = tap.read_jsonl(path)
    assert [e.step for e in events] == [0, 1, 2, 3]
    (msg,) = tap_warnings(caught)
    assert path in msg and "line (5)" in msg and "cut mid-write" in msg


def test_a_garbage_line_in_the_middle_names_file_and_line(tmp_path):
    path = write_events(tmp_path / "run.jsonl", 4)
    lines = open(path).read().splitlines(keepends=True)
    lines.insert(2, "{not json at all\n")
    open(path, "w").writelines(lines)
    with pytest.raises(ValueError, match=rf"{path}, line 3: not valid JSON"):
        tap.read_jsonl(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = tap.read_jsonl(path, errors="skip")
    assert [e.step for e in events] == [0, 1, 2, 3]
    (msg,) = tap_warnings(caught)
    assert "skipped 1 unreadable line" in msg and "line 3" in msg


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["__value__"].update(dtype="float33"), "unknown dtype 'float33'"),
    (lambda r: r.pop("step"), "'step' must be an int"),
    (lambda r: r.pop("__value__"), "unknown format"),
    (lambda r: r["__value__"].update(shape=[100000, 100000, 100000]), r"does not match its shape \[100000, 100000, 100000\]"),
    (lambda r: r["__value__"].update(shape=[2]), r"does not match its shape \[2\]"),
    (lambda r: r["__value__"].update(shape=[-3]), "non-negative ints"),
    (lambda r: r.update(kind="gradient"), "'kind' must be"),
])
def test_bad_values_are_clear_errors_checked_before_allocation(tmp_path, edit, message):
    path = str(tmp_path / "bad.jsonl")
    with tap.JSONLWriter(path) as out:
        out(tap.TapEvent("scan[0]", 0, np.arange(3, dtype=np.float32), 1))
    rec = json.loads(open(path).read())
    edit(rec)
    open(path, "w").write(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=rf"{path}, line 1: .*{message}"):
        tap.read_jsonl(path)


def test_errors_must_be_raise_or_skip(tmp_path):
    path = write_events(tmp_path / "run.jsonl", 1)
    with pytest.raises(ValueError, match="errors= must be 'raise' or 'skip'"):
        tap.read_jsonl(path, errors="ignore")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255), st.sampled_from(["flip", "cut", "insert"])),
                      min_size=1, max_size=4))
def test_random_byte_corruption_never_escapes_as_anything_but_a_named_error(tmp_path_factory, edits):
    path = str(tmp_path_factory.mktemp("fuzz") / "run.jsonl")
    clean = open(write_events(path, 6), "rb").read()
    data = bytearray(clean)
    for pos, byte, how in edits:
        pos %= max(len(data), 1)
        if how == "flip":
            data[pos] = byte
        elif how == "cut":
            del data[pos:pos + 1 + byte % 7]
        else:
            data[pos:pos] = bytes([byte])
    open(path, "wb").write(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tap.TapWarning)
        try:
            events = tap.read_jsonl(path)
        except ValueError as exc:
            assert f"{path}, line " in str(exc)
        else:
            assert all(isinstance(e, tap.TapEvent) for e in events)
        skipped = tap.read_jsonl(path, errors="skip")
    assert len(skipped) <= 6 + sum(how == "insert" for _, _, how in edits)


# ------------------------------------------------------------ streaming
def test_iter_jsonl_streams_events_before_reading_the_rest(tmp_path):
    path = write_events(tmp_path / "run.jsonl", 3)
    with open(path, "a") as fh:
        fh.write("garbage\n")
    it = tap.iter_jsonl(path)
    assert next(it).step == 0 and next(it).step == 1  # read before the bad line is reached
    with pytest.raises(ValueError, match="line 4"):
        list(it)


def test_columns_stream_into_a_dataframe_like_the_recorder(tmp_path):
    pd = pytest.importorskip("pandas")
    path = str(tmp_path / "run.jsonl")
    rec = tap.FlightRecorder()
    with tap.JSONLWriter(path) as out:
        g = tap.verbose(lambda x: jax.lax.scan(lambda c, _: ((c[0] + 1.0, c[1] * 2), None), x, None, length=4),
                        on_step=lambda e: (out(e), rec(e)))
        sync(g((jnp.float32(0.0), jnp.int32(1))))
    cols = tap.read_jsonl_columns(path)
    assert cols["step"].tolist() == [0, 1, 2, 3] and cols["value_1"].tolist() == [2, 4, 8, 16]
    df = pd.DataFrame(cols)
    pd.testing.assert_frame_equal(df[["path", "step", "value_0", "value_1"]], rec.df(), check_dtype=False)


# ------------------------------------------------------------ jax-tap 0.3.1 files
def test_reads_files_written_by_the_published_package(tmp_path):
    path = str(tmp_path / "old.jsonl")
    lines = [
        {"path": "scan[0]", "step": 0, "value_kind": "tuple", "value": [1.5, [1, 2]], "kind": "carry", "total": 3},
        {"path": "scan[0]", "step": 1, "value_kind": "array", "value": [[1.0, 2.0], [3.0, 4.0]], "kind": "carry"},
        {"path": "scan[0]/cholesky[0]", "step": -1, "value_kind": "none", "value": None, "kind": "primitive"},
        {"path": "while[0]", "step": 2, "value_kind": "scalar", "value": 7, "kind": "carry"},
        {"path": "while[0]", "step": 3, "value_kind": "repr", "value": "Array(1.)", "kind": "output"},
    ]
    open(path, "w").write("".join(json.dumps(x) + "\n" for x in lines))
    events = tap.read_jsonl(path)
    assert [(e.path, e.step, e.total, e.kind) for e in events] == [
        ("scan[0]", 0, 3, "carry"), ("scan[0]", 1, None, "carry"), ("scan[0]/cholesky[0]", -1, None, "primitive"),
        ("while[0]", 2, None, "carry"), ("while[0]", 3, None, "output")]
    first = events[0].value
    assert isinstance(first, tuple) and float(first[0]) == 1.5 and first[1].tolist() == [1, 2]
    assert events[1].value.shape == (2, 2) and events[2].value is None
    assert int(events[3].value) == 7 and events[4].value == "Array(1.)"


def test_an_unknown_format_names_file_line_and_both_formats(tmp_path):
    path = str(tmp_path / "other.jsonl")
    open(path, "w").write(json.dumps({"path": "scan[0]", "step": 0, "val": 1}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}, line 1: unknown format.*'__value__'.*'value_kind'"):
        tap.read_jsonl(path)


# ------------------------------------------------------------ fault injection
CHILD = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, jaxtap as tap
    out = tap.JSONLWriter(sys.argv[1])
    def body(c, _):
        return c + 1.0, None
    with tap.record(on_step=out):
        jax.block_until_ready(jax.lax.scan(body, jnp.zeros(2000, jnp.float32), None, length=10**7)[0])
""")


def test_a_child_killed_with_sigkill_leaves_every_whole_line_readable(tmp_path):
    path = str(tmp_path / "killed.jsonl")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen([sys.executable, "-c", CHILD, path], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(path) and os.path.getsize(path) > 400_000:
                break
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = tap.read_jsonl(path)
    whole = open(path, "rb").read().count(b"\n")
    assert len(events) == whole > 10  # every whole line, nothing else
    assert [e.step for e in events] == list(range(len(events)))
    assert all(e.value[0].shape == (2000,) and e.value[0][0] == e.step + 1 for e in events)
    assert len(tap_warnings(caught)) <= 1  # only if the kill cut a line


class _FillsUp:
    """A file that takes ``room`` whole lines, then half a line, then ENOSPC."""

    def __init__(self, fh, room):
        self.fh, self.room = fh, room

    def write(self, text):
        if self.room == 0:
            self.fh.write(text[: len(text) // 2])
            self.fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return self.fh.write(text)

    def flush(self):
        self.fh.flush()

    def close(self):
        self.fh.close()


def test_a_disk_filling_up_mid_run_keeps_the_file_and_the_program(tmp_path):
    path = str(tmp_path / "full.jsonl")
    f = lambda x: jax.lax.scan(lambda c, _: (c * 1.5 + 1.0, c), x, None, length=40)  # noqa: E731
    out = tap.JSONLWriter(path)
    out._fh = _FillsUp(out._fh, room=17)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tap.record(on_step=out):
            got = sync(f(jnp.float32(0.5)))
        out.close()
    assert_bits(got, f(jnp.float32(0.5)))
    (msg,) = tap_warnings(caught)
    assert "No space left" in msg and path in msg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = tap.read_jsonl(path)
    assert [e.step for e in events] == list(range(17))  # every event written before the fault
    assert len(tap_warnings(caught)) == 1  # the half line at the end


def test_keyboard_interrupt_while_a_buffered_block_is_delivered(tmp_path):
    # Ctrl-C landing in a consumer mid-batch is the user's: it stops the run
    # (never swallowed as a consumer failure) and the block raises it as
    # Python would; every event before the interrupt point was delivered
    # once, and the function after the block is the user's own, bitwise
    seen = []

    def on_step(e):
        seen.append(e.step)
        if e.step == 13:
            raise KeyboardInterrupt

    f = lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=50)  # noqa: E731
    path = tmp_path / "run.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            with tap.JSONLWriter(path) as w, tap.record(on_step=lambda e: (w(e), on_step(e)), flush_every=8) as rec:
                sync(f(jnp.float32(0.0)))
    assert seen == list(range(14))
    steps = [e.step for e in rec.events]
    assert steps == list(range(len(steps))) and 14 <= len(steps) < 50
    assert [e.step for e in tap.read_jsonl(path)] == list(range(14))
    assert tap_warnings(caught) == []
    assert_bits(f(jnp.float32(0.0)), jax.jit(f)(jnp.float32(0.0)))


def test_vmap_lanes_survive_the_file(tmp_path):
    path = str(tmp_path / "lanes.jsonl")
    f = lambda x: jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=2)[0]  # noqa: E731
    with tap.JSONLWriter(path) as out, tap.record(on_step=out, select=lambda leaves: leaves[0]) as rec:
        sync(jax.vmap(f)(jnp.arange(3.0)))
    back = tap.read_jsonl(path)
    assert [(e.path, e.step, e.lane) for e in back] == [(e.path, e.step, e.lane) for e in rec.events]
    assert {e.lane for e in back} == {0, 1, 2}


def test_a_writer_to_os_devnull_never_removes_it(monkeypatch):
    """In a multi-process run a writer removes the empty shared file it
    created; a device such as os.devnull (writable as root) is not one."""
    removed = []
    monkeypatch.setattr(os, "remove", removed.append)
    monkeypatch.setattr(_seam, "process_tag", lambda: 1)
    out = tap.JSONLWriter(os.devnull, overwrite=True)
    out.close()  # idle in a multi-process run: the shared name would be left
    assert removed == []


class _Pair(collections.namedtuple("_Pair", "a b")):
    pass


class _Box:  # a pytree node whose aux data cannot be hashed (no template: the general path)
    def __init__(self, x):
        self.x = x

    def __repr__(self):
        return f"_Box({self.x!r})"


jax.tree_util.register_pytree_node(_Box, lambda b: ((b.x,), [1]), lambda aux, children: _Box(children[0]))


def test_an_events_line_from_its_template_is_the_line_json_writes():
    """A single event's line (unbuffered delivery) comes from a cached
    template where it can; for every value, templated or not, it is the
    line ``json`` writes (the reader's format)."""
    from jaxtap import _jsonl
    from jaxtap._event import make_event
    import ml_dtypes
    values = [np.float32(0.3), np.float64(-1e-7), np.int32(-5), np.uint32(2**32 - 1), np.bool_(True),
              np.arange(4, dtype=np.float32) / 3, np.arange(6, dtype=np.int64).reshape(2, 3),
              (np.arange(2, dtype=np.float32), np.bool_(False), np.int32(3)), {"a": np.float32(1.5), "b": None},
              [np.float32(3e30), np.array([True, False])],
              # not templated: each written by json as before
              np.float32(np.nan), np.array([1.0, np.inf], np.float32), np.asarray(1.0), 1.5, 7, "text",
              np.uint64(2**64 - 1), np.int8(-3), np.float16(0.5), np.array(1.5, ml_dtypes.bfloat16),
              np.complex64(1 + 2j), (np.float32(1.0), "static"), np.zeros((0, 3), np.float32),
              _Pair(np.float32(1.5), np.arange(2)), {1: np.float32(3.0)}, _Box(np.float32(2.5)),
              # written by repr, which pads numbers by the widest: never from a template
              _Box(np.array([8, 15], np.int32)), _Box(np.array([57, 106], np.int32)),
              # dicts a hop would have sorted; keys that cannot be sorted
              {"b": np.float32(1.0), "a": np.int32(5)}, {2: np.arange(1.0), 1: np.arange(2.0)},
              {1: np.float32(1.0), "a": np.float32(2.0)}]
    tags = [(10, None, (None, None, None, None)), (10, 2, (1, "cpu:0", 0, True)),
            (True, True, (True, 1, True, 1)), (1.0, 1, (1, True, 1, True))]  # (equal keys, other texts)
    for value in values:
        for step, (total, lane, origin) in zip((3, np.int64(4), 5, 6), tags):
            event = make_event("scan[0]/while[2]", step, value, total, "carry", lane, origin)
            assert _jsonl._event_text(event) == _jsonl._line(event), value
    templated = make_event("scan[0]", 3, np.arange(3, dtype=np.float32), None, "carry")
    _jsonl._template.cache_clear()
    _jsonl._event_text(templated)
    assert _jsonl._template.cache_info().currsize == 1
