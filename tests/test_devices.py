"""Many devices and many processes: loops inside shard_map / pmap are tapped,
each shard's events tagged with its shard and device; sharded jit keeps one
event per step; jax.distributed runs tag their process and write one JSONL
file per process. Four CPU devices need XLA_FLAGS before JAX starts, so each
check runs in a fresh interpreter (one per group, results as JSON)."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jaxtap as tap

_PRELUDE = """
import os, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P, NamedSharding
import jaxtap as tap
AT = jax.sharding.AxisType
RESULT = {}

def bits(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb))

def summary(events):
    return [[e.path, e.step, e.kind, e.shard, e.device, e.process, e.lane] for e in events]

def run(name, fn, *args, **cfg):
    base = jax.block_until_ready(fn(*args))
    with tap.record(**cfg) as rec:
        out = jax.block_until_ready(fn(*args))
    RESULT[name] = {"events": summary(rec.events), "same": bits(base, out),
                    "sharding": str(getattr(out, "sharding", None)) == str(getattr(base, "sharding", None))}
    return rec

def body(c, _):
    c = c * 1.01 + 0.5
    return c, c.sum()

def scan5(x):
    return lax.scan(body, x, None, length=5)
"""


def _run(script, timeout=240):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_ENABLE_X64", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_PRELUDE) + textwrap.dedent(script)
                           + "\nprint('RESULT=' + json.dumps(RESULT))"],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT="):]), proc.stderr


@pytest.fixture(scope="module")
def four():
    """One interpreter with 4 CPU devices, running every single-process case."""
    return _run("""
        mesh = jax.make_mesh((4,), ("x",), axis_types=(AT.Auto,), devices=jax.devices()[::-1])
        RESULT["mesh_devices"] = [d.id for d in mesh.devices.flat]
        sm = jax.jit(jax.shard_map(scan5, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))
        x = jnp.arange(8.0)
        run("shard_map", sm, x)
        run("shard_map_buffered", sm, x, flush_every=3)
        run("shard_map_ys", sm, x, select_ys=lambda ys: ys)
        run("shard_map_eager", jax.shard_map(scan5, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))), x)
        evs = []
        wrapped = tap.verbose(jax.shard_map(scan5, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))),
                              on_step=evs.append)
        out = jax.block_until_ready(jax.jit(wrapped)(x)); jax.effects_barrier()
        RESULT["verbose"] = {"events": summary(evs), "same": bits(sm(x), out)}

        mesh2 = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AT.Auto, AT.Auto))
        RESULT["mesh2_devices"] = [[d.id for d in row] for row in mesh2.devices]
        run("partial_auto", jax.jit(jax.shard_map(scan5, mesh=mesh2, in_specs=P("x"), out_specs=(P("x"), P("x")),
                                                  axis_names={"x"})), x)
        run("two_axes", jax.jit(jax.shard_map(scan5, mesh=mesh2, in_specs=P(("x", "y")),
                                              out_specs=(P(("x", "y")), P(("x", "y"))))), x)
        run("pmap", jax.pmap(scan5), x.reshape(4, 2))
        run("vmap_in_shard_map", jax.jit(jax.shard_map(jax.vmap(scan5), mesh=mesh, in_specs=P("x"),
                                                       out_specs=(P("x"), P("x")))), x.reshape(4, 2))

        def grow(x):  # a while loop whose trip count differs per shard
            return lax.while_loop(lambda c: c[1][0] < 10, lambda c: (c[0] + 1, c[1] * 1.5 + 1), (0, x))[1]
        gw = jax.jit(jax.shard_map(grow, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        run("while", gw, x)
        run("while_buffered", gw, x, flush_every=4)

        def mixed(x):
            def b(c, _):
                return c + lax.psum(c, "x") * 0.01, None
            return lax.scan(b, x, None, length=5)[0]
        mx = jax.shard_map(mixed, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        run("psum", jax.jit(mx), x)
        run("grad", jax.jit(jax.grad(lambda x: (mx(x) ** 2).sum())), x)
        run("jvp", jax.jit(lambda x: jax.jvp(mx, (x,), (jnp.ones_like(x),))), x)

        xs = jax.device_put(x, NamedSharding(mesh, P("x")))
        run("sharded_jit", jax.jit(scan5), xs)
        run("sharded_jit_mean", jax.jit(scan5), xs, select=lambda c: jnp.mean(c[0]))
        explicit = jax.make_mesh((4,), ("x",), axis_types=(AT.Explicit,))
        xe = jax.device_put(x, NamedSharding(explicit, P("x")))
        run("explicit_jit", jax.jit(scan5), xe)
        run("explicit_jit_buffered", jax.jit(scan5), xe, flush_every=2)
        run("explicit_jit_ys", jax.jit(scan5), xe, select_ys=lambda ys: ys)
        run("explicit_shard_map", jax.jit(jax.shard_map(scan5, mesh=explicit, in_specs=P("x"),
                                                        out_specs=(P("x"), P("x")))), xe)
        run("per_shard", jax.jit(scan5), xe, per_shard=True)
        run("per_shard_buffered", jax.jit(scan5), xe, per_shard=True, flush_every=2)
        m22 = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AT.Explicit, AT.Explicit))
        run("per_shard_2x2", jax.jit(scan5), jax.device_put(x, NamedSharding(m22, P("x"))), per_shard=True)
        RESULT["m22_devices"] = [[d.id for d in row] for row in m22.devices]
        with jax.set_mesh(explicit):
            run("per_shard_set_mesh", jax.jit(scan5), xe, per_shard=True)

            def const_ys(x):  # a mesh-less constant y: the scan's ys are mesh-less too
                return lax.scan(lambda c, _: (c * 1.5 + 1.0, 2.0), x, None, length=3)

            def types(fn):
                return [(str(a.sharding), a.weak_type) for a in jax.make_jaxpr(fn)(xe).out_avals]

            plain_types = types(const_ys)
            with tap.record():
                RESULT["const_ys_types"] = [plain_types, types(const_ys)]
        RESULT["explicit_devices"] = [d.id for d in explicit.devices.flat]
        with tap.record(per_shard=True) as rec:
            jax.block_until_ready(jax.jit(scan5)(xe))
        with tap.record() as whole:
            jax.block_until_ready(jax.jit(scan5)(xe))
        pieces = {}
        for e in rec.events:
            pieces.setdefault(e.step, {})[e.shard] = np.asarray(e.value[0])
        RESULT["per_shard_pieces"] = all(
            np.concatenate([pieces[e.step][s] for s in range(4)]).tobytes() == np.asarray(e.value[0]).tobytes()
            and pieces[e.step][0].shape == (2,) for e in whole.events)
        donated = jax.jit(lambda x: lax.scan(body, x, None, length=5)[0], donate_argnums=0)
        a = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        with tap.record() as rec:
            out = jax.block_until_ready(donated(a))
        RESULT["donation"] = {"deleted": a.is_deleted(), "events": len(rec.events),
                              "sharding": str(out.sharding) == str(NamedSharding(mesh, P("x")))}

        inner = jax.shard_map(lambda x: scan5(x)[0], mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        around = jax.jit(lambda x: lax.scan(lambda c, _: (inner(c), None), x, None, length=2)[0])
        run("loop_around_shard_map", around, x)
        run("loop_around_shard_map_buffered", around, x, flush_every=4)

        def nanny(x):  # shard 2 turns NaN from step 3
            def b(c, _):
                c = c + 1.0
                bad = ((lax.axis_index("x") == 2) & (c[0] > 7.5)).astype(c.dtype)
                return c + 0.0 * jnp.log(c - 100.0 * bad), None
            return lax.scan(b, x, None, length=5)[0]
        with tap.record(taps=[tap.watch_nan("log")]):
            jax.block_until_ready(jax.jit(jax.shard_map(nanny, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x))
        jax.effects_barrier()

        # review regressions: a jitted loop shared by two meshes of one shape
        # (its trace is cached per abstract mesh: the devices must not be)
        @jax.jit
        def shared(c):
            return lax.scan(lambda c, _: (c + 0.0, None), c, None, length=2)[0]
        RESULT["shared_jit"] = []
        for devs in (jax.devices(), jax.devices()[::-1]):
            m = jax.make_mesh((4,), ("x",), axis_types=(AT.Auto,), devices=devs)
            with tap.record() as rec:
                out = jax.block_until_ready(jax.jit(jax.shard_map(shared, mesh=m, in_specs=P("x"),
                                                                  out_specs=P("x")))(jnp.arange(4.0)))
            RESULT["shared_jit"].append([sorted((int(e.value[0][0]), e.device) for e in rec.events if e.step == 0),
                                         sorted((int(np.asarray(sh.data)[0]), sh.device.id)
                                                for sh in out.addressable_shards)])
        # a scalar carry started on no mesh, updated from explicitly sharded values
        xe4 = jax.device_put(jnp.arange(8.0), NamedSharding(jax.make_mesh((4,), ("x",), axis_types=(AT.Explicit,)),
                                                            P("x")))
        two = jax.jit(lambda x: lax.scan(lambda c, _: ((c[0] * 1.1, c[1] + c[0].sum()), None),
                                         (x, jnp.float32(0)), None, length=4)[0])
        run("scalar_from_sharded", two, xe4, flush_every=3)
        run("scalar_from_sharded_per_shard", two, xe4, flush_every=3, per_shard=True)
        # rows with and without tags: a while loop around a shard_map
        inner_sm = jax.shard_map(lambda x: scan5(x)[0], mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        wh = jax.jit(lambda x: lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, inner_sm(c[1])), (0, x))[1])
        with tap.record() as rec:
            jax.block_until_ready(wh(x))
        df = rec.df()
        RESULT["mixed_df"] = {k: str(df[k].dtype) for k in ("shard", "device")}

        # payloads over XLA's 100 KiB async host-copy limit: each shard's hop (and a
        # gathered sharded carry) would deadlock 4 CPU devices on 2 cores unshipped in pieces
        big = jnp.linspace(0.0, 1.0, 4 * 32768, dtype=jnp.float32)
        run("big_shard_map", sm, big)
        run("big_shard_map_buffered", sm, big, flush_every=4)
        run("big_sharded_jit", jax.jit(scan5), jax.device_put(jnp.linspace(0.0, 1.0, 262144, dtype=jnp.float32),
                                                             NamedSharding(mesh, P("x"))))

        import tempfile
        path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        with tap.JSONLWriter(path) as w:
            run("jsonl", sm, x, on_step=w)
        RESULT["jsonl_back"] = summary(tap.read_jsonl(path))
        with tap.record(flush_every=5) as rec:
            jax.block_until_ready(sm(x))
        df = rec.df()
        RESULT["df"] = {"columns": list(df.columns), "shards": sorted(set(df["shard"].tolist())),
                        "devices": sorted(set(df["device"].tolist())), "rows": len(df)}
    """)


def _shards(r):
    return sorted({e[3] for e in r["events"]})


def _per_shard_steps(r):
    out = {}
    for path, step, kind, shard, *_ in r["events"]:
        out.setdefault((shard, kind), []).append(step)
    return out


def test_shard_map_gives_each_shard_its_events(four):
    r, _ = four
    sm = r["shard_map"]
    assert sm["same"] and sm["sharding"]
    assert len(sm["events"]) == 20
    assert _shards(sm) == [0, 1, 2, 3]
    assert all(steps == [0, 1, 2, 3, 4] for steps in _per_shard_steps(sm).values())
    # the device is the mesh's device of that shard (the mesh is reversed here)
    assert {e[3]: e[4] for e in sm["events"]} == dict(enumerate(r["mesh_devices"]))
    assert all(e[5] is None for e in sm["events"])  # one process: no process tag


@pytest.mark.parametrize("name", ["shard_map_buffered", "shard_map_eager", "verbose", "pmap", "psum"])
def test_shard_map_variants_match(four, name):
    r, _ = four
    got = r[name]
    assert got["same"]
    assert len(got["events"]) == 20 and _shards(got) == [0, 1, 2, 3]
    assert all(steps == [0, 1, 2, 3, 4] for steps in _per_shard_steps(got).values())


def test_buffered_shard_map_equals_unbuffered(four):
    r, _ = four
    key = lambda e: (e[3], e[1])  # noqa: E731
    assert sorted(r["shard_map_buffered"]["events"], key=key) == sorted(r["shard_map"]["events"], key=key)


def test_scan_outputs_per_shard(four):
    r, _ = four
    got = _per_shard_steps(r["shard_map_ys"])
    assert sorted(got) == [(s, k) for s in range(4) for k in ("carry", "output")]
    assert r["shard_map_ys"]["same"]


def test_partial_auto_mesh_reports_one_event_per_manual_shard(four):
    r, _ = four
    got = r["partial_auto"]
    assert got["same"] and len(got["events"]) == 10 and _shards(got) == [0, 1]
    # a manual shard's callback runs on its first device along the automatic axis
    assert {e[3]: e[4] for e in got["events"]} == {0: r["mesh2_devices"][0][0], 1: r["mesh2_devices"][1][0]}
    two = r["two_axes"]
    assert two["same"] and _shards(two) == [0, 1, 2, 3]
    flat = [d for row in r["mesh2_devices"] for d in row]
    assert {e[3]: e[4] for e in two["events"]} == dict(enumerate(flat))


def test_vmap_inside_shard_map(four):
    r, _ = four
    got = r["vmap_in_shard_map"]
    assert got["same"] and len(got["events"]) == 20 and _shards(got) == [0, 1, 2, 3]


def test_while_loop_trip_counts_per_shard(four):
    r, _ = four
    for name in ("while", "while_buffered"):
        got = r[name]
        assert got["same"] and _shards(got) == [0, 1, 2, 3]
        trips = {s: len(steps) for (s, _), steps in _per_shard_steps(got).items()}
        assert trips[0] > trips[3]  # shard 0 starts smallest: it loops longest
    key = lambda e: (e[3], e[1])  # noqa: E731
    assert sorted(r["while"]["events"], key=key) == sorted(r["while_buffered"]["events"], key=key)


def test_gradients_through_shard_map_are_bitwise(four):
    r, _ = four
    assert r["grad"]["same"] and r["jvp"]["same"]
    assert _shards(r["grad"]) == [0, 1, 2, 3]


def test_sharded_jit_one_event_per_step(four):
    r, _ = four
    for name in ("sharded_jit", "sharded_jit_mean"):
        got = r[name]
        assert got["same"] and got["sharding"]
        assert [e[1] for e in got["events"]] == [0, 1, 2, 3, 4]
        assert all(e[3] is None and e[4] is None for e in got["events"])


def test_shard_map_inside_a_tapped_loop(four):
    r, _ = four
    got = r["loop_around_shard_map"]
    assert got["same"]
    outer = [e for e in got["events"] if e[0] == "scan[0]"]
    inner = [e for e in got["events"] if e[0] == "scan[0]/scan[0]"]
    assert [e[1] for e in outer] == [0, 1] and all(e[3] is None for e in outer)
    assert len(inner) == 2 * 5 * 4 and sorted({e[3] for e in inner}) == [0, 1, 2, 3]
    assert {e[3]: e[4] for e in inner} == dict(enumerate(r["mesh_devices"]))
    # inside a buffered step the shard_map's loops are silent (README: Many devices)
    buffered = r["loop_around_shard_map_buffered"]
    assert buffered["same"] and [e[:2] for e in buffered["events"]] == [["scan[0]", 0], ["scan[0]", 1]]


def test_alert_lines_name_the_shard(four):
    _, err = four
    fails = [ln for ln in err.splitlines() if ln.startswith("[tap] FAIL")]
    # mesh devices reversed: shard 2 holds x[4:6] = 4, 5 -> c[0] > 7.5 from step 3
    assert fails and all("[shard 2]" in ln for ln in fails), fails
    assert "[tap] FAIL scan[0]/log[0] 3/5 [shard 2]: NaN/Inf" in fails


def test_review_regressions(four):
    r, _ = four
    for tagged, actual in r["shared_jit"]:
        assert tagged == actual  # the device that holds each shard, for both meshes
    assert r["scalar_from_sharded"]["same"] and len(r["scalar_from_sharded"]["events"]) == 4
    assert r["scalar_from_sharded_per_shard"]["same"] and len(r["scalar_from_sharded_per_shard"]["events"]) == 16
    assert r["mixed_df"] == {"shard": "Int64", "device": "Int64"}


def test_prng_key_carry_buffered_like_unbuffered():
    import jax

    step = jax.jit(lambda k: jax.lax.scan(lambda k, _: (jax.random.split(k)[0], None), k, None, length=3)[0])
    got = []
    for cfg in ({}, {"flush_every": 2}):
        with tap.record(**cfg) as rec:
            jax.block_until_ready(step(jax.random.key(0)))
        jax.effects_barrier()
        got.append([np.asarray(e.value[0]).tobytes() for e in rec.events])
    assert len(got[0]) == 3 and got[0] == got[1]


def test_large_payloads_do_not_deadlock(four):
    r, _ = four
    for name, n in (("big_shard_map", 20), ("big_shard_map_buffered", 20), ("big_sharded_jit", 5)):
        assert r[name]["same"] and len(r[name]["events"]) == n, name


def test_explicit_mesh(four):
    """Explicit sharding types: the traced step keeps them; hops and buffers
    take the values unsharded."""
    r, _ = four
    for name, n in (("explicit_jit", 5), ("explicit_jit_buffered", 5), ("explicit_jit_ys", 10)):
        assert r[name]["same"] and r[name]["sharding"] and len(r[name]["events"]) == n, name
    got = r["explicit_shard_map"]
    assert got["same"] and len(got["events"]) == 20 and _shards(got) == [0, 1, 2, 3]
    # (helper-34: the ys buffer took the context mesh, another type than the
    # scan's ys; now the same type, and that loop runs untapped with a warning)
    plain, tapped = r["const_ys_types"]
    assert plain == tapped


def test_per_shard_under_a_sharded_jit(four):
    """per_shard=True: each shard ships its own piece (no gather), tagged."""
    r, _ = four
    for name in ("per_shard", "per_shard_buffered", "per_shard_set_mesh"):
        got = r[name]
        assert got["same"] and got["sharding"] and len(got["events"]) == 20 and _shards(got) == [0, 1, 2, 3], name
        assert all(steps == [0, 1, 2, 3, 4] for steps in _per_shard_steps(got).values()), name
    assert r["per_shard_pieces"]  # the pieces are the carry's shards, bit for bit
    # under jax.set_mesh the device of each shard is known
    assert {e[3]: e[4] for e in r["per_shard_set_mesh"]["events"]} == dict(enumerate(r["explicit_devices"]))
    # split along x only on a 2x2 mesh: one event per piece, not one per device
    two = r["per_shard_2x2"]
    assert two["same"] and len(two["events"]) == 10 and _shards(two) == [0, 1]


def test_donation_and_output_sharding_kept(four):
    r, _ = four
    assert r["donation"] == {"deleted": True, "events": 5, "sharding": True}


def test_tags_survive_jsonl_and_df(four):
    r, _ = four
    # device threads call back concurrently: two consumers may see shards interleaved differently
    key = lambda e: (e[3], e[1])  # noqa: E731
    assert sorted(r["jsonl_back"], key=key) == sorted(r["jsonl"]["events"], key=key)
    df = r["df"]
    assert df["rows"] == 20 and df["shards"] == [0, 1, 2, 3] and sorted(df["devices"]) == sorted(r["mesh_devices"])
    assert df["columns"][:5] == ["path", "step", "shard", "device", "value"]


def test_tags_in_event_and_line_format(tmp_path):
    e = tap.TapEvent("scan[0]", 1, 2.0, 5, shard=3, device=7, process=1)
    assert (e.shard, e.device, e.process) == (3, 7, 1)
    assert repr(e).endswith("kind='carry', shard=3, device=7, process=1)")
    assert "shard" not in repr(tap.TapEvent("scan[0]", 1, 2.0, 5))
    path = tmp_path / "t.jsonl"
    with tap.JSONLWriter(str(path)) as w:
        w(e)
        w(tap.TapEvent("scan[0]", 2, 3.0, 5))
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert (lines[0]["shard"], lines[0]["device"], lines[0]["process"]) == (3, 7, 1)
    assert "shard" not in lines[1]
    assert tap.read_jsonl(str(path))[0] == e
    path.write_text(json.dumps({**lines[0], "shard": "zero"}) + "\n")
    with pytest.raises(ValueError, match="'shard' must be an int"):
        tap.read_jsonl(str(path))


def test_read_jsonl_merges_process_files(tmp_path):
    base = tmp_path / "run.jsonl"
    for proc in (1, 0):
        with tap.JSONLWriter(str(tmp_path / f"run.p{proc}.jsonl")) as w:
            for call in range(2):  # a loop called twice, an inner loop run per outer step
                for outer in range(2):
                    w(tap.TapEvent("scan[0]", outer, float(outer), 2, process=proc))
                    for inner in range(3):
                        w(tap.TapEvent("scan[0]/scan[0]", inner, float(call), 3, process=proc))
    got = tap.read_jsonl(str(base))
    assert [e.process for e in got] == [0] * 16 + [1] * 16
    mine = [(e.path, e.step, e.value) for e in got[:16]]
    assert mine[:4] == [("scan[0]", 0, 0.0), ("scan[0]", 1, 1.0), ("scan[0]", 0, 0.0), ("scan[0]", 1, 1.0)]
    # each run of the inner loop stays whole, runs in their order
    assert [s for _, s, _ in mine[4:]] == [0, 1, 2] * 4 and [v for *_, v in mine[4:]] == [0.0] * 6 + [1.0] * 6
    assert len(list(tap.iter_jsonl(str(base)))) == 32
    assert not base.exists()


_WORKER = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
port, pid, out, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
import jaxtap as tap
writer = tap.JSONLWriter(out) if mode == "api" else None  # made before initialize: still one file per process
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)
import json, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P, NamedSharding
mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
def f(x):
    def body(c, _):
        return c * 0.5 + lax.psum(c, "x") * 0.125, None
    return lax.scan(body, x, None, length=5)[0]
g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
arr = jax.make_array_from_callback((8,), NamedSharding(mesh, P("x")),
                                   lambda idx: np.arange(8.0, dtype=np.float32)[idx])
if mode == "api":
    base = jax.block_until_ready(g(arr))
    with tap.record(on_step=writer) as rec:
        out = jax.block_until_ready(g(arr))
    writer.close()
    same = all(np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
               for a, b in zip(base.addressable_shards, out.addressable_shards))
    mine = sorted({d.id for d in jax.local_devices()})
    print("RESULT=" + json.dumps({"n": len(rec.events), "same": same, "mine": mine, "file": writer.path,
                                  "tags": sorted({(e.shard, e.device, e.process) for e in rec.events})}))
else:
    jax.block_until_ready(g(arr))
jax.distributed.shutdown()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(tmp_path, mode):
    """Start 2 processes x 2 CPU devices on 127.0.0.1; every wait bounded,
    everything started is killed."""
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    out, port = str(tmp_path / "run.jsonl"), _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_ENABLE_X64")}
    pre = [sys.executable, "-m", "jaxtap", "--jsonl", out] if mode == "cli" else [sys.executable]
    procs = [subprocess.Popen(pre + [str(worker), str(port), str(i), out, mode], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text[-3000:]
    return out, outs


def test_two_processes_each_get_their_own_events(tmp_path):
    out, outs = _two_processes(tmp_path, "api")
    for pid, text in enumerate(outs):
        r = json.loads([ln for ln in text.splitlines() if ln.startswith("RESULT=")][-1][len("RESULT="):])
        assert r["same"] and r["n"] == 10
        assert r["file"].endswith(f"run.p{pid}.jsonl")
        assert {t[2] for t in r["tags"]} == {pid}  # the process tag
        assert sorted(t[1] for t in r["tags"]) == r["mine"]  # only its own devices' events
        assert sorted(t[0] for t in r["tags"]) == [2 * pid, 2 * pid + 1]
    merged = tap.read_jsonl(out)
    assert len(merged) == 20
    assert [(e.process, e.step, e.shard) for e in merged] == sorted(  # (process, path, step, shard) order
        (p, k, s) for p in range(2) for s in (2 * p, 2 * p + 1) for k in range(5))
    assert not os.path.exists(out)  # no empty shared file left beside the per-process ones


def test_two_processes_under_the_cli(tmp_path):
    out, _ = _two_processes(tmp_path, "cli")
    merged = tap.read_jsonl(out)
    assert len(merged) == 20
    assert sorted({(e.process, e.shard) for e in merged}) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert np.all([e.path == "scan[0]" for e in merged])
