"""Many devices: the cost of tapping a loop under ``shard_map`` and under a
sharded ``jit``, against the untapped sharded program and a raw
``jax.debug.callback`` in the same run.

    python bench/devices.py            # 4 CPU devices, writes bench/devices.json
    python bench/devices.py --smoke    # fewer steps and repeats; reports, never asserts

Each arm runs a ``scan`` whose carry is one float32 vector sharded over 4
devices (``--size`` floats in all), ``--steps`` steps, under ``jax.jit``. We
report the median time per step after a warm-up call, and ratios to the
untapped program and to the floor (a hand-written ``jax.debug.callback``
shipping the step and the same payload every step).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxtap as tap  # noqa: E402


def body(c, _):
    return c * 0.999 + jnp.sin(c) * 0.01, None


def program(steps, raw=None):
    """The loop; ``raw``: ship (step, payload(c)) with jax.debug.callback each step."""
    def f(x):
        if raw is None:
            return lax.scan(body, x, None, length=steps)[0]

        def b(carry, _):
            i, c = carry
            c, _ = body(c, None)
            jax.debug.callback(lambda *a: None, i, raw(c))
            return (i + 1, c), None
        return lax.scan(b, (jnp.int32(0), x), None, length=steps)[0][1]
    return f


def timeit(fn, x, repeats, cfg):
    def once():
        t = time.perf_counter()
        if cfg is None:
            jax.block_until_ready(fn(x))
        else:
            with tap.record(**cfg):
                jax.block_until_ready(fn(x))
        jax.effects_barrier()
        return time.perf_counter() - t

    first = once()
    return statistics.median(once() for _ in range(repeats)), first


def arms(steps, size):
    """(family, name, jitted fn, tap config or None, input) of every family."""
    auto = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    explicit = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    data = jnp.linspace(0.0, 1.0, size, dtype=jnp.float32)
    xa = jax.device_put(data, NamedSharding(auto, P("x")))
    xe = jax.device_put(data, NamedSharding(explicit, P("x")))
    sm = lambda f: jax.jit(jax.shard_map(f, mesh=auto, in_specs=P("x"), out_specs=P("x")))  # noqa: E731
    plain = program(steps)
    mean = lambda c: jnp.mean(c)  # noqa: E731
    whole = lambda c: c  # noqa: E731
    out = []
    for family, wrap, x in (("shard_map", sm, xa), ("sharded jit", jax.jit, xa)):
        out += [
            (family, "untapped", wrap(plain), None, x),
            (family, "raw debug.callback, whole carry", wrap(program(steps, whole)), None, x),
            (family, "raw debug.callback, its mean", wrap(program(steps, mean)), None, x),
            (family, "tapped, whole carry", wrap(plain), {}, x),
            (family, "tapped, select=mean", wrap(plain), {"select": lambda leaves: jnp.mean(leaves[0])}, x),
            (family, "tapped, progress idiom select=lambda _: ()", wrap(plain), {"select": lambda _: ()}, x),
            (family, "tapped, whole carry, flush_every=50", wrap(plain), {"flush_every": 50}, x),
        ]
    family = "explicit-axes jit"
    out += [
        (family, "untapped", jax.jit(plain), None, xe),
        (family, "raw debug.callback, whole carry", jax.jit(program(steps, whole)), None, xe),
        (family, "tapped, whole carry (gathered)", jax.jit(plain), {}, xe),
        (family, "tapped, per_shard=True", jax.jit(plain), {"per_shard": True}, xe),
        (family, "tapped, per_shard=True, flush_every=50", jax.jit(plain), {"per_shard": True, "flush_every": 50},
         xe),
    ]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--size", type=int, default=4 * 4096)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "devices.json"))
    args = ap.parse_args(argv)
    steps = args.steps or (100 if args.smoke else 1000)
    repeats = 3 if args.smoke else 7
    rows, base = [], {}
    for family, name, fn, cfg, x in arms(steps, args.size):
        per, first = timeit(fn, x, repeats, cfg)
        us = per / steps * 1e6
        if name == "untapped":
            base[(family, "untapped")] = us
        if name.startswith("raw") and name.endswith("whole carry"):
            base[(family, "floor")] = us
        rows.append({"family": family, "arm": name, "us_per_step": us, "first_call_s": first,
                     "x_untapped": us / base[(family, "untapped")],
                     "x_floor": us / base[(family, "floor")] if (family, "floor") in base else None})
        print(f"{family:12s} {name:46s} {us:10.2f} us/step  x{rows[-1]['x_untapped']:.2f} untapped"
              + (f"  x{rows[-1]['x_floor']:.2f} floor" if rows[-1]["x_floor"] else ""), flush=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": sys.version.split()[0],
            "jax": jax.__version__, "devices": 4, "steps": steps, "size": args.size, "repeats": repeats,
            "date": time.strftime("%Y-%m-%d")}
    if not args.smoke:
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
