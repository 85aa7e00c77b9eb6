"""Columnar delivery of buffered telemetry: a hop's rows stay columns
(``TapBlock``) in the recorder, the JSONL writer, the CLI and ``on_block``
consumers, and become the same TapEvents, in the same order, on demand."""
import collections
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap


def run(f, *args, **cfg):
    with tap.record(**cfg) as rec:
        out = jax.block_until_ready(f(*args))
    jax.effects_barrier()
    return out, rec


def nested(x):
    def outer(c, _):
        c = jax.lax.scan(lambda d, _: (d * 0.5 + 1.0, None), c, None, length=3)[0]
        c = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] + 0.25), (0, c))[1]
        return c, c.sum()
    return jax.lax.scan(outer, x, None, length=23)


SELECTS = {
    "bare scalar": lambda leaves: leaves[-1].sum(),
    "bare vector": lambda leaves: leaves[-1],
    "default (all leaves)": None,
    "tree with a static leaf": lambda leaves: {"m": leaves[-1].mean(), "tag": "x", "v": leaves[-1][:2]},
}


def as_bits(events):
    out = []
    for e in events:
        leaves = [np.asarray(v) for v in jax.tree_util.tree_leaves(e.value)]
        out.append((e.path, e.step, e.total, e.kind, e.lane, type(e.step),
                    tuple((v.dtype.str, v.shape, v.tobytes()) for v in leaves),
                    tuple(type(v) for v in jax.tree_util.tree_leaves(e.value))))
    return out


@pytest.mark.parametrize("select", SELECTS, ids=list(SELECTS))
@pytest.mark.parametrize("batched", [False, True], ids=["plain", "vmap"])
def test_blocks_become_the_events_per_event_delivery_gives(select, batched):
    f = jax.jit(jax.vmap(nested) if batched else nested)
    x = jnp.ones((2, 3)) if batched else jnp.ones(3)
    out0, per_event = run(f, x, select=SELECTS[select], on_step=lambda e: None)  # an on_step needs events
    out1, columns = run(f, x, select=SELECTS[select], flush_every=7)
    out2, unbuffered = run(f, x, select=SELECTS[select])
    assert any(isinstance(i, tap.TapBlock) for i in columns._events)
    assert len(columns) == len(unbuffered) == len(columns.events)
    assert as_bits(sorted(columns.events, key=lambda e: (e.path, e.lane or 0))) == \
        as_bits(sorted(unbuffered.events, key=lambda e: (e.path, e.lane or 0)))
    for a, b in zip(jax.tree_util.tree_leaves(out1), jax.tree_util.tree_leaves(out2)):
        assert np.array_equal(a, b)


def test_order_across_loops_is_arrival_order():
    _, blocks = run(jax.jit(nested), jnp.ones(3), select=lambda leaves: leaves[-1].sum(), flush_every=5)
    _, events = run(jax.jit(nested), jnp.ones(3), select=lambda leaves: leaves[-1].sum(), flush_every=5,
                    on_step=lambda e: None)
    assert as_bits(blocks.events) == as_bits(events.events)


def test_df_from_columns_equals_df_from_events():
    pd = pytest.importorskip("pandas")
    sel = SELECTS["tree with a static leaf"]
    _, blocks = run(jax.jit(nested), jnp.ones(3), select=sel, flush_every=4)
    _, events = run(jax.jit(nested), jnp.ones(3), select=sel, flush_every=4, on_step=lambda e: None)
    a, b = blocks.df(kind=True, total=True), events.df(kind=True, total=True)
    assert list(a.columns) == list(b.columns)
    assert a.drop(columns=["v"]).equals(b.drop(columns=["v"]))
    assert all(np.array_equal(x, y) for x, y in zip(a["v"], b["v"]))
    assert isinstance(a, pd.DataFrame) and len(a) == len(blocks)


def test_a_bounded_recorder_keeps_the_last_events():
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=250)[0])
    with tap.record(select=lambda leaves: leaves[0], flush_every=100, maxlen=30) as rec:
        f(jnp.float32(0))
    assert [e.step for e in rec.events] == list(range(220, 250)) and len(rec) == 30


def test_on_block_consumers_get_columns_and_jsonl_writes_the_same_lines(tmp_path):
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=250)[0])
    blocks = []

    class Plot:  # a live plot would draw each block's columns
        def on_block(self, block):
            blocks.append((block.path, block.steps.copy(), np.array(block.values)))

        def __call__(self, event):
            raise AssertionError("events are not needed")

    with tap.record(select=lambda leaves: leaves[0], flush_every=100, on_step=Plot()) as rec:
        f(jnp.float32(0))
    assert [len(s) for _, s, _ in blocks] == [100, 100, 50]
    assert np.array_equal(np.concatenate([v for *_, v in blocks]), np.arange(1.0, 251.0, dtype=np.float32))
    assert len(rec) == 250
    per_block, per_event = tmp_path / "b.jsonl", tmp_path / "e.jsonl"
    with tap.JSONLWriter(per_block) as w:
        with tap.record(select=lambda leaves: leaves[0], flush_every=100, on_step=w):
            f(jnp.float32(0))
    with tap.JSONLWriter(per_event) as w:
        with tap.record(select=lambda leaves: leaves[0], flush_every=100, on_step=lambda e: w(e)):
            f(jnp.float32(0))
    assert per_block.read_text() == per_event.read_text()
    assert len(per_block.read_text().splitlines()) == 250


@pytest.mark.parametrize("select", [lambda leaves: leaves[0].astype(jnp.int32),
                                    lambda leaves: jnp.where(leaves[0] > 3, jnp.nan, leaves[0]),
                                    lambda leaves: jnp.stack([leaves[0], -leaves[0]]),
                                    lambda leaves: jnp.stack([jnp.stack([leaves[0], leaves[0] * 1e-7, -leaves[0] / 3]),
                                                              jnp.stack([leaves[0] * 3e30, leaves[0] + 0.1, 0 * leaves[0]])]),
                                    lambda leaves: (leaves[0] * jnp.arange(6.0).reshape(3, 2)).astype(jnp.int32),
                                    lambda leaves: jnp.full(5000, leaves[0]),
                                    lambda leaves: {"c": leaves[0], "big": leaves[0] > 10, "n": jnp.int32(2)}],
                         ids=["int", "with NaN", "vector", "matrix at every magnitude", "int matrix", "wider than a template",
                              "tree"])
def test_jsonl_lines_of_any_block_equal_per_event_lines(select, tmp_path):
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=30)[0])
    texts = []
    for name, wrap in (("b", lambda w: w), ("e", lambda w: (lambda e: w(e)))):
        path = tmp_path / f"{name}.jsonl"
        with tap.JSONLWriter(path) as w:
            with tap.record(select=select, flush_every=8, on_step=wrap(w)):
                f(jnp.float32(0))
        texts.append(path.read_text())
    assert texts[0] == texts[1] and len(texts[0].splitlines()) == 30
    assert [e.step for e in tap.read_jsonl(tmp_path / "b.jsonl")] == list(range(30))


def test_a_raising_on_block_warns_once_and_the_recorder_keeps_everything():
    class Bad:
        def on_block(self, block):
            raise RuntimeError("plot broke")

        def __call__(self, event):
            pass

    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=50)[0])
    with pytest.warns(tap.TapWarning, match="plot broke"):
        out, rec = run(f, jnp.float32(0), select=lambda leaves: leaves[0], flush_every=10, on_step=Bad())
    assert float(out) == 50.0 and len(rec) == 50


def test_an_alert_gets_events():
    seen = []
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=20)[0])
    _, rec = run(f, jnp.float32(0), select=lambda leaves: leaves[0], flush_every=10,
                 alert=lambda e: seen.append(e.step) or False)
    assert seen == list(range(20)) and not any(isinstance(i, tap.TapBlock) for i in rec._events)


def test_a_million_buffered_scalar_events_take_a_few_megabytes():
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=1_000_000)[0])
    _, rec = run(f, jnp.float32(0), select=lambda leaves: leaves[0], flush_every=10_000)
    blocks = [i for i in rec._events if isinstance(i, tap.TapBlock)]
    assert len(rec) == 1_000_000 and len(blocks) == 100
    assert sum(b.nbytes() for b in blocks) <= 8 * 1_000_000  # int32 step + float32 value per event


def test_cli_counts_blocks(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text("import jax, jax.numpy as jnp\n"
                      "print(float(jax.lax.scan(lambda c, _: (c + 1.0, None), jnp.float32(0), None, length=300)[0]))\n")
    r = subprocess.run([sys.executable, "-m", "jaxtap", "--flush-every", "100", "--jsonl", "run.jsonl", "s.py"],
                       cwd=tmp_path, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "300.0"
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [d["step"] for d in lines] == list(range(300))


def test_only_a_class_defined_on_block_opts_in():
    from unittest import mock

    class EvenSteps(tap.FlightRecorder):  # changes __call__ only: still wants events
        def __call__(self, event):
            if event.step % 2 == 0:
                super().__call__(event)

    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=10)[0])
    m, even = mock.Mock(), EvenSteps()
    for consumer in (m, even):
        run(f, jnp.float32(0), select=lambda leaves: leaves[0], flush_every=5, on_step=consumer)
    assert m.call_count == 10 and m.on_block.call_count == 0
    assert [e.step for e in even.events] == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("select", [
    lambda leaves: leaves[0].astype(jnp.bfloat16),
    lambda leaves: leaves[0].astype(jnp.complex64),
    lambda leaves: {"step": leaves[0] * 10, "kind": leaves[0] * 2},
    lambda leaves: Point(leaves[0]),
], ids=["bfloat16", "complex64", "keys named like columns", "custom pytree"])
def test_df_of_blocks_types_its_columns_as_rows_do(select):
    pytest.importorskip("pandas")
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=6)[0])
    _, blocks = run(f, jnp.float32(0), select=select, flush_every=3)
    _, events = run(f, jnp.float32(0), select=select, flush_every=3, on_step=lambda e: None)
    a, b = blocks.df(kind=True), events.df(kind=True)
    assert list(a.columns) == list(b.columns) and list(a.dtypes) == list(b.dtypes)
    assert a.astype(str).equals(b.astype(str))


def test_df_keeps_bools_beside_numbers_as_objects():
    pytest.importorskip("pandas")

    def two(x):
        b = jax.lax.scan(lambda c, _: (~c, None), x > 0, None, length=4)[0]
        i = jax.lax.scan(lambda c, _: (c + 1, None), jnp.int32(5), None, length=4)[0]
        return b, i

    _, blocks = run(jax.jit(two), jnp.float32(1), select=lambda leaves: leaves[0], flush_every=2)
    _, events = run(jax.jit(two), jnp.float32(1), select=lambda leaves: leaves[0], flush_every=2,
                    on_step=lambda e: None)
    for rec in (blocks, events):
        df = rec.df()  # (two independent loops: XLA may run either first)
        assert df[df.path == "scan[0]"]["value"].tolist() == [False, True, False, True]
        assert df[df.path == "scan[1]"]["value"].tolist() == [6, 7, 8, 9]
        assert df["value"].dtype == object


def test_no_empty_blocks_and_blocks_are_read_only():
    got = []

    class Plot:
        def on_block(self, block):
            got.append((block.lane, len(block)))
            block.values[0] = 99.0  # a consumer may not rewrite what others see

        def __call__(self, event):
            pass

    def count(n):
        return jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] + 1.0), (0, 0.0))[1]

    with pytest.warns(tap.TapWarning, match="read-only"):
        _, rec = run(jax.jit(jax.vmap(count)), jnp.array([0, 3, 5]), select=lambda leaves: leaves[1],
                     flush_every=4, on_step=Plot())
    assert all(n > 0 for _, n in got) and {lane for lane, _ in got} == {1, 2}
    assert sorted((e.lane, e.step, float(e.value)) for e in rec.events) == \
        [(1, s, s + 1.0) for s in range(3)] + [(2, s, s + 1.0) for s in range(5)]


def test_assigning_events_keeps_a_running_block_recording():
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=10)[0])
    for cfg in ({}, {"flush_every": 5}):
        with tap.record(select=lambda leaves: leaves[0], **cfg) as rec:
            f(jnp.float32(0))
            jax.effects_barrier()
            rec.events = []
            f(jnp.float32(0))
        assert len(rec) == len(rec.events) == 10


@jax.tree_util.register_dataclass
@__import__("dataclasses").dataclass
class Point:
    x: jax.Array


def test_a_while_loop_nested_in_a_loop_buffers_at_most_64_rows_a_flush():
    sizes = []

    class Sizes:
        def on_block(self, block):
            sizes.append((block.path, len(block)))

        def __call__(self, event):
            pass

    def f(x):
        def outer(c, _):
            c = jax.lax.while_loop(lambda s: s[0] < 100, lambda s: (s[0] + 1, s[1] * 1.001), (0, c))[1]
            return c, None
        return jax.lax.scan(outer, x, None, length=3)[0]

    out, rec = run(jax.jit(f), jnp.float32(1), select=lambda leaves: leaves[-1], flush_every=1000, on_step=Sizes())
    _, plain = run(jax.jit(f), jnp.float32(1), select=lambda leaves: leaves[-1])
    assert [n for p, n in sizes if p == "scan[0]/while[0]"] == [64, 36] * 3  # not a 1000-row buffer per run
    assert as_bits(sorted(rec.events, key=lambda e: e.path)) == as_bits(sorted(plain.events, key=lambda e: e.path))


def _mixed(x):
    """A while loop (its hops are gated) and a scan, carrying leaves of
    several kinds (bool, complex, int8, a PRNG key, a static leaf)."""
    def body(s):
        i, v, flag, z, small, key = s
        key, sub = jax.random.split(key)
        return i + 1, v * 0.5 + jax.random.normal(sub, v.shape), v.sum() > 1, z * (1 + 1j), small + 1, key
    start = (0, x, False, jnp.complex64(1), jnp.int8(3), jax.random.key(0))
    s = jax.lax.while_loop(lambda s: s[0] < 5, body, start)
    return jax.lax.scan(lambda c, _: (c + s[1], c.sum()), x, None, length=4)


@pytest.mark.parametrize("every", [1, 2])
def test_a_recorder_alone_keeps_unbuffered_hops_as_bytes_until_read(every, monkeypatch):
    from jaxtap import _delivery
    unpacked = []
    real = _delivery.unpack
    monkeypatch.setattr(_delivery, "unpack", lambda buf, plan: unpacked.append(np.shape(buf)) or real(buf, plan))
    f = jax.jit(_mixed)
    out0, kept = run(f, jnp.ones(3), sample_every=every)
    assert unpacked == [] and len(kept) == (5 + 4 if every == 1 else 3 + 2)  # nothing unpacked while running
    _, per_event = run(f, jnp.ones(3), sample_every=every, on_step=lambda e: None)
    assert as_bits(kept.events) == as_bits(per_event.events)
    assert [rows for rows, _ in unpacked] == ([5, 4] if every == 1 else [3, 2])  # a stack per site
    assert as_bits(kept.events) == as_bits(per_event.events) and len(unpacked) == 2  # decoded once, kept
    assert kept.df().drop(columns=["value_1"]).equals(per_event.df().drop(columns=["value_1"]))
    with tap.record(select=lambda leaves: leaves[1], sample_every=every, where=lambda p: "while" in p) as bare:
        f(jnp.ones(3))
    assert [(e.step, np.asarray(e.value).tobytes()) for e in bare.events] == \
        [(e.step, np.asarray(e.value[1]).tobytes()) for e in per_event.events if "while" in e.path]


def test_a_recorder_that_kept_bytes_pickles_and_copies_as_its_events():
    import copy
    import pickle
    f = jax.jit(_mixed)
    _, per_event = run(f, jnp.ones(3), on_step=lambda e: None)
    for read_first in (False, True):
        _, kept = run(f, jnp.ones(3))
        if read_first:
            kept.events
        back = pickle.loads(pickle.dumps(kept))  # a kept block's decoder is a closure: it must not travel
        assert as_bits(back.events) == as_bits(per_event.events) and len(back) == len(per_event)
        assert as_bits(copy.deepcopy(kept).events) == as_bits(per_event.events)
        assert back.df().drop(columns=["value_1"]).equals(per_event.df().drop(columns=["value_1"]))


def test_a_read_recorder_holds_each_kept_event_once():
    """Once read, a kept hop's bytes go: the recorder holds its events, as
    per-event delivery's does, not the events and the bytes."""
    import gc
    import tracemalloc
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c * 1.01, None), x, None, length=20)[0])
    x = jnp.ones(250_000)  # 1 MB a hop
    jax.block_until_ready(f(x))

    def held(**cfg):
        gc.collect()
        tracemalloc.start()
        try:
            _, rec = run(f, x, **cfg)
            events = rec.events
            assert len(events) == 20
            del events
            gc.collect()
            return rec, tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    per_event, base = held(on_step=lambda e: None)
    kept, mine = held()
    assert base > 20e6 and mine < 1.25 * base
    assert as_bits(kept.events) == as_bits(per_event.events)
    assert sum(b.nbytes() for b in kept._events) == 20 * (4 + 1_000_000)  # a step and a row each


@jax.tree_util.register_pytree_node_class
class _Boxed:
    """A custom node whose rebuilding calls JAX (as many ``__init__`` do)."""

    def __init__(self, a):
        self.a = jnp.asarray(a)

    def tree_flatten(self):
        return (self.a,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _types_read_inside_jit(rec) -> list:
    """The types of each event's ``value.a`` as read while ``jit`` traces."""
    seen = []

    @jax.jit
    def reads_inside_a_trace(y):
        seen.extend(type(e.value.a) for e in rec.events)
        return y

    reads_inside_a_trace(1.0)
    return seen


@pytest.mark.parametrize("flush_every", [None, 2], ids=["unbuffered", "buffered"])
@pytest.mark.parametrize("batched", [False, True], ids=["plain", "vmap"])
def test_a_custom_node_is_rebuilt_in_its_hop_not_where_the_recorder_is_read(flush_every, batched):
    g = lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0]  # noqa: E731
    f = jax.jit(jax.vmap(g) if batched else g)
    _, rec = run(f, jnp.ones((3, 2)) if batched else jnp.ones(2), select=lambda leaves: _Boxed(leaves[0]),
                 flush_every=flush_every)
    seen = _types_read_inside_jit(rec)
    assert seen and not any(issubclass(t, jax.core.Tracer) for t in seen)
    assert not any(isinstance(e.value.a, jax.core.Tracer) for e in rec.events)


class _Coerced(collections.namedtuple("_Coerced", "a b")):
    """A namedtuple subclass whose ``__new__`` calls JAX: JAX rebuilds a
    namedtuple by calling its class, so it is no built-in container."""

    def __new__(cls, a, b):
        return super().__new__(cls, jnp.asarray(a), b)


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "vmap"])
def test_a_namedtuple_subclass_with_its_own_new_is_rebuilt_in_its_hop(batched):
    def f(x):
        return jax.lax.scan(lambda c, _: (c * 1.5, None), x, None, length=3)[0]

    x = jnp.array([0.3, 1.0, 2.0], jnp.float32)
    _, rec = run(jax.vmap(f) if batched else f, x if batched else x[0],
                 select=lambda leaves: _Coerced(leaves[0], leaves[0] + 1))
    seen = _types_read_inside_jit(rec)
    assert seen and not any(issubclass(t, jax.core.Tracer) for t in seen)


def _mixed_step(c, _):
    """One step over leaves of interleaved widths (a hop packs them piece by
    piece or, on JAX 0.12, joined by dtype)."""
    i8, f32, flag, z, u16, bf, ints, f16, i4 = c
    return (i8 + 1, f32 * 1.5, ~flag, z * (1 + 1j), u16 * 3, bf + 0.5, ints * 2 + 1, f16 * 0.75, i4 + 1), None


def _mixed_carry(lane):
    return (jnp.int8(3 + lane), jnp.float32(1.5 + lane), jnp.bool_(lane % 2 == 0), jnp.complex64(1 + 2j * lane),
            jnp.uint16(7), jnp.bfloat16(2.5), jnp.arange(3, dtype=jnp.int32) + lane, jnp.float16(0.5),
            jnp.array([1, -2, lane], jnp.int4))


@pytest.mark.parametrize("flush_every", [None, 2])
@pytest.mark.parametrize("batched", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("kept", [True, False], ids=["recorder alone", "with on_step"])
def test_a_carry_of_interleaved_dtypes_comes_back_leaf_for_leaf(flush_every, batched, kept):
    """A hop packs leaves of interleaved dtypes (this JAX's way, see
    ``_seam.JOIN_BY_DTYPE``) and the host takes them apart: every leaf of
    every step must come back in its place, with its dtype and bits
    (per-event delivery, kept bytes, buffered, per lane)."""
    def f(c):
        return jax.lax.scan(_mixed_step, c, None, length=3)[0]

    lanes = [0, 1] if batched else [0]
    c0 = jax.tree.map(lambda *v: jnp.stack(v), *map(_mixed_carry, lanes)) if batched else _mixed_carry(0)
    g = jax.jit(jax.vmap(f) if batched else f)
    extra = {} if kept else {"on_step": lambda e: None}
    with tap.record(flush_every=flush_every, **extra) as rec:
        out = g(c0)
        jax.effects_barrier()
    assert [np.asarray(a).tobytes() for a in jax.tree.leaves(out)] == \
        [np.asarray(a).tobytes() for a in jax.tree.leaves(g(c0))]
    for lane in lanes:
        c, step_of = _mixed_carry(lane), {}
        for k in range(3):
            c = jax.jit(_mixed_step)(c, None)[0]
            step_of[k] = c
        got = [e for e in rec.events if (e.lane or 0) == lane]
        assert [e.step for e in got] == [0, 1, 2]
        for e in got:
            want = jax.tree.leaves(step_of[e.step])
            have = jax.tree.leaves(e.value)
            assert [np.asarray(a).dtype for a in have] == [np.asarray(a).dtype for a in want]
            assert [np.asarray(a).tobytes() for a in have] == [np.asarray(a).tobytes() for a in want]


@pytest.mark.parametrize("by_dtype", [False, True], ids=["piece by piece", "joined by dtype"])
def test_both_ways_of_packing_a_hop_unpack_leaf_for_leaf(by_dtype):
    """Either packing (each JAX uses one: ``_seam.JOIN_BY_DTYPE``) and its
    plan agree: every leaf comes back with its dtype, shape and bits."""
    from jaxtap._delivery import unpack, unpack_plan
    from jaxtap._emit import _pack
    leaves = jax.tree.leaves(_mixed_carry(1)) + [jnp.eye(3, dtype=jnp.float32), jnp.zeros((0, 2), jnp.int16),
                                                jnp.complex64(3 - 1j), jax.random.key(3)]
    packed, layout = jax.jit(lambda *a: _pack(a, by_dtype=by_dtype)[0])(*leaves), _pack(leaves, by_dtype)[1]
    back = unpack(np.asarray(packed), unpack_plan(layout, by_dtype=by_dtype))
    want = [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else x)
            for x in leaves]
    assert [(b.dtype, b.shape, b.tobytes()) for b in map(np.asarray, back)] == \
        [(w.dtype, w.shape, w.tobytes()) for w in want]


def _lanes_while(x):
    """Lanes that finish at different steps (their later hops carry a false flag)."""
    return jax.lax.while_loop(lambda s: s[1] < 3.0, lambda s: (s[0] + 1, s[1] * 1.5 + 0.1, s[2] ^ 1),
                              (0, x, jnp.int8(1)))


def _lanes_scan(x):
    return jax.lax.scan(lambda c, _: ({"a": c["a"] * 0.5 + 1.0, "n": c["n"] + 1}, None),
                        {"a": x * jnp.ones(2), "n": jnp.int32(0)}, None, length=7)[0]


LANE_CASES = {  # (the vmapped program, its options, the program of one lane)
    "while, lanes finish apart": (jax.vmap(_lanes_while), {}, _lanes_while),
    "scan, dict carry": (jax.vmap(_lanes_scan), {}, _lanes_scan),
    "bare select": (jax.vmap(_lanes_scan), {"select": lambda leaves: leaves[0]}, _lanes_scan),
    "sample_every=3": (jax.vmap(_lanes_while), {"sample_every": 3}, _lanes_while),
    "nested vmap": (jax.vmap(jax.vmap(_lanes_scan)), {}, None),
}


def _each_lane_alone(events, one, x, **cfg):
    """Each lane's events (vmapped run) are the events of that lane run alone."""
    for lane in range(len(x)):
        _, alone = run(jax.jit(one), x[lane], **cfg)
        mine = [dataclasses.replace(e, lane=None) for e in events if e.lane == lane]
        assert as_bits(mine) == as_bits(alone.events) and mine


@pytest.mark.parametrize("case", LANE_CASES, ids=list(LANE_CASES))
def test_a_recorder_alone_keeps_a_vmapped_hops_lanes_as_bytes_until_read(case, monkeypatch):
    """A wide vmap's hop: the recorder keeps every lane's row as one block of
    bytes (nothing unpacked while running), and reading it gives the events
    per-event delivery gives, in the same order, df and pickles included."""
    import pickle
    from jaxtap import _delivery
    fn, cfg, one = LANE_CASES[case]
    x = jnp.linspace(0.2, 1.3, 6).reshape(2, 3) if case == "nested vmap" else jnp.linspace(0.2, 1.3, 5)
    f = jax.jit(fn)
    unpacked = []
    real = _delivery.unpack
    monkeypatch.setattr(_delivery, "unpack", lambda buf, plan: unpacked.append(np.shape(buf)) or real(buf, plan))
    out, kept = run(f, x, **cfg)
    running = list(unpacked)
    _, per_event = run(f, x, on_step=lambda e: None, **cfg)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(f(x))))
    blocks = [i for i in kept._events if isinstance(i, tap.TapBlock)]
    assert running == [] and blocks and all(b.lanes is not None for b in blocks)
    assert len(blocks) < len(per_event)
    assert len(kept) == len(per_event) > 0
    assert as_bits(kept.events) == as_bits(per_event.events)
    if one is not None:
        _each_lane_alone(kept.events, one, x, **cfg)
    assert kept.df().equals(per_event.df())
    back = pickle.loads(pickle.dumps(run(f, x, **cfg)[1]))
    assert as_bits(back.events) == as_bits(per_event.events)


@pytest.mark.parametrize("flush_every", [1, 4])
@pytest.mark.parametrize("case", ["while, lanes finish apart", "scan, dict carry", "bare select", "nested vmap"])
def test_a_recorder_alone_takes_a_vmapped_buffered_hop_as_one_block(case, flush_every):
    """Buffered under vmap: each flush's rows of every lane (as many as each
    lane wrote) reach a recorder as one block, lane after lane, and read back
    as the events lane-by-lane delivery gives."""
    fn, cfg, one = LANE_CASES[case]
    x = jnp.linspace(0.2, 1.3, 6).reshape(2, 3) if case == "nested vmap" else jnp.linspace(0.2, 1.3, 5)
    f = jax.jit(fn)
    out, kept = run(f, x, flush_every=flush_every, **cfg)
    _, per_event = run(f, x, on_step=lambda e: None, flush_every=flush_every, **cfg)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(f(x))))
    blocks = [i for i in kept._events if isinstance(i, tap.TapBlock)]
    assert blocks and all(b.lanes is not None for b in blocks) and len(blocks) < len(per_event)
    assert len(kept) == len(per_event) > 0
    assert as_bits(kept.events) == as_bits(per_event.events)
    if one is not None:
        _each_lane_alone(per_event.events, one, x, flush_every=flush_every, **cfg)
    assert kept.df().equals(per_event.df())


def _numbers():
    rng = np.random.default_rng(7)
    mags = 10.0 ** rng.uniform(-320, 308, 200_000)
    edges = [0.0, -0.0, 1e-4, -1e-4, 9.999999999999999e-05, 1e-5, 1e15, 1e16, 9999999999999998.0, 1e16 + 2, 0.1,
             5e-324, 1.7976931348623157e308, 1.0, 3.0, 123456789.0, 2.0 ** 53, 2.0 ** 60]
    f64 = np.concatenate([mags * rng.choice([-1, 1], mags.size), edges, rng.normal(size=10_000),
                          rng.integers(-10**6, 10**6, 10_000).astype(float)])
    with np.errstate(over="ignore"):  # (magnitudes past float32's range become inf, then go)
        f32 = np.concatenate([f64.astype(np.float32), np.array([np.float32(2.0) ** -130], np.float32)])
    f32 = f32[np.isfinite(f32)]
    ints = [rng.integers(-2**31, 2**31, 10_000).astype(np.int32), rng.integers(-2**63, 2**63 - 1, 10_000),
            np.array([0, -1, 2**63 - 1, -2**63], np.int64)]
    return [f64, f32, *ints]


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "repr"])
def test_a_blocks_numbers_are_written_as_python_writes_them(fast, monkeypatch):
    """The JSONL block writer's number texts (orjson's C digits where
    installed) equal ``repr`` of the Python number, at every magnitude."""
    from jaxtap import _jsonl
    if fast:
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(_jsonl, "_orjson", None)
    for col in _numbers():
        assert _jsonl._number_texts(col) == list(map(repr, col.tolist())), col.dtype


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "repr"])
def test_jsonl_block_lines_equal_event_lines_at_every_magnitude(fast, tmp_path, monkeypatch):
    from jaxtap import _jsonl
    if not fast:
        monkeypatch.setattr(_jsonl, "_orjson", None)
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c * 7.3e-3, None), x, None, length=60)[0])
    texts = []
    for name, wrap in (("b", lambda w: w), ("e", lambda w: (lambda e: w(e)))):
        path = tmp_path / f"{name}.jsonl"
        with tap.JSONLWriter(path) as w:
            with tap.record(select=lambda leaves: leaves[0], flush_every=25, on_step=wrap(w)):
                f(jnp.float32(3e30))
        texts.append(path.read_text())
    assert texts[0] == texts[1] and len(texts[0].splitlines()) == 60
    assert "e-" in texts[0] and "e+" in texts[0]  # magnitudes repr writes with an exponent


def test_a_recorder_alone_keeps_unbuffered_events_without_an_object_each():
    """Unbuffered hops a recorder alone keeps are bytes in one run, not a
    Python object per event (which every garbage collection of the
    process would walk); read, they are the events per-event delivery
    gives, in arrival order across interleaved loops."""
    import gc

    def nest(x):
        def outer(c, _):
            c = jax.lax.scan(lambda d, _: (d * 1.001, None), c, None, length=3)[0]
            return c + 1.0, None
        return jax.lax.scan(outer, x, None, length=2000)[0]

    f = jax.jit(nest)
    for _ in range(2):  # the second block reuses the first one's compilation
        with tap.record():
            jax.block_until_ready(f(jnp.ones(2)))
    gc.collect()
    before = len(gc.get_objects())
    with tap.record() as kept:
        jax.block_until_ready(f(jnp.ones(2)))
        jax.effects_barrier()
    gc.collect()
    assert len(kept) == 8000 and len(gc.get_objects()) - before < 400, len(gc.get_objects()) - before
    _, per_event = run(f, jnp.ones(2), on_step=lambda e: None)
    assert as_bits(kept.events) == as_bits(per_event.events)
    assert [e.path for e in kept.events[:5]] == ["scan[0]/scan[0]"] * 3 + ["scan[0]", "scan[0]/scan[0]"]


def test_reading_a_recorder_while_its_loop_runs_keeps_every_event_in_order():
    """Reads on the host while the loop runs (a live plot) open the run of
    kept bytes; later hops start a new one; nothing is lost or reordered."""
    seen = []

    def f(x):
        def body(c, _):
            jax.debug.callback(lambda: seen.append(len(rec.events)))
            return c + 1.0, None
        return jax.lax.scan(body, x, None, length=50)[0]

    with tap.record() as rec:
        jax.block_until_ready(jax.jit(f)(jnp.float32(0.0)))
        jax.effects_barrier()
    assert [e.step for e in rec.events] == list(range(50)) and len(rec) == 50
    assert [float(e.value[0]) for e in rec.events] == [float(i + 1) for i in range(50)]  # (the carry leaves)
    assert seen == sorted(seen) and seen[-1] >= 40  # the reads saw the run grow


def test_keep_times_after_kept_events_lines_up_times_with_events(tmp_path):
    """Arrival times start where keep_times() is called: the events kept
    before it (bytes in one run) have none, each later event its own."""
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3)[0])
    g, rec = tap.record(f)
    g(jnp.float32(0.0))
    rec.keep_times()
    g(jnp.float32(10.0))
    items, stamps = rec._snapshot(times=True)
    assert len(items) == len(stamps) == 6
    assert [t is None for t in stamps] == [True] * 3 + [False] * 3
    assert [float(e.value[0]) for e in rec.events] == [1.0, 2.0, 3.0, 11.0, 12.0, 13.0]


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_recorder_copied_while_its_loop_runs_copies_what_it_holds(how):
    """Copies taken by another thread while hops arrive (kept bytes growing
    at the end of the store) hold TapEvents only, as many as they say."""
    import copy
    import pickle
    import threading
    copies, done = [], threading.Event()

    def copier():
        while not done.is_set():
            copies.append(pickle.loads(pickle.dumps(rec)) if how == "pickle" else copy.deepcopy(rec))

    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=5_000)[0])
    jax.block_until_ready(f(jnp.float32(0.0)))
    with tap.record() as rec:
        thread = threading.Thread(target=copier)
        thread.start()
        try:
            jax.block_until_ready(f(jnp.float32(0.0)))
            jax.effects_barrier()
        finally:
            done.set()
            thread.join()
    assert len(rec) == 5_000 and len(copies) >= 2
    for c in copies:
        events = c.events
        assert len(events) == len(c) and all(isinstance(e, tap.TapEvent) for e in events)
        assert [e.step for e in events] == list(range(len(events)))


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "repr"])
@pytest.mark.parametrize("shape", [(), (4,), (2, 3), "tree"], ids=["scalar", "vector", "matrix", "tree"])
def test_a_block_of_arrays_is_written_in_one_go_as_its_event_lines(shape, fast, monkeypatch):
    """Blocks of fixed-shape int, bool or finite float arrays (or pytrees
    of them) take the block path (one template, no line built per event),
    and its text is the per-event lines', at every magnitude."""
    from jaxtap import _jsonl
    if fast:
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(_jsonl, "_orjson", None)
    for col in _numbers():
        if shape == "tree":  # a dict of a number matrix, a bool vector, a scalar, a key's data
            rows = col[:len(col) // 6 * 6].reshape(-1, 3, 2)
            n = len(rows)
            leaves = [np.arange(n, dtype=np.int32), np.arange(2 * n, dtype=np.uint32).reshape(n, 2) * 97, rows,
                      np.arange(3 * n).reshape(n, 3) % 3 == 0]  # (in the dict's key order)
            tree = jax.tree_util.tree_structure({"i": 0, "m": 0, "ok": 0, "key": 0})
            block = tap.TapBlock("scan[0]/while[1]", "carry", 99, None, np.arange(n) * 7, leaves=leaves,
                                 treedef=tree, count=4)
        else:
            width = max(1, int(np.prod(shape)))
            rows = col[:len(col) // width * width].reshape((-1,) + shape)
            block = tap.TapBlock("scan[0]/while[1]", "carry", 99, None, np.arange(len(rows)) * 7, rows)
        text = _jsonl._block_text(block)
        assert text is not None, (col.dtype, shape)
        assert text == "".join(_jsonl._line(e) for e in block.events()), (col.dtype, shape)
