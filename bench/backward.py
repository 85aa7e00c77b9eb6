"""Cotangent taps: the cost of ``backward=True`` per backward step, against
the untapped gradient and the hop floor, measured in the same run.

    python bench/backward.py            # writes bench/backward.json
    python bench/backward.py --smoke    # fewer steps and repeats; reports, never asserts

The program is ``jax.jit(jax.grad(loss))`` of a ``scan`` (``--steps`` steps,
a float32 carry of ``--size`` floats, one closed-over parameter). Each arm
runs it after a warm-up call; we report the median time of a call, the
extra time per step over the untapped gradient, and that extra divided by
the floor: a hand-written ``jax.debug.callback`` shipping the step and the
whole carry every forward step of the same loop (one hop per step; a
``jax.debug.callback`` cannot sit in the backward loop without a custom
rule). The lens arms tap the forward loop too (``kind="carry"``), so the
"backward only" column subtracts the forward-only arm.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxtap as tap  # noqa: E402


def make_loss(steps, raw=False):
    def loss(w, x):
        def body(carry, _):
            i, c = carry
            c = jnp.sin(w * c) * 0.99 + 0.01
            if raw:
                jax.debug.callback(lambda *a: None, i, c)
            return (i + 1, c), None
        return jnp.sum(lax.scan(body, (jnp.int32(0), x), None, length=steps)[0][1])
    return jax.jit(jax.grad(loss))


def timeit(fn, args, repeats, cfg):
    def once():
        t = time.perf_counter()
        if cfg is None:
            jax.block_until_ready(fn(*args))
        else:
            with tap.record(**cfg):
                jax.block_until_ready(fn(*args))
        jax.effects_barrier()
        return time.perf_counter() - t

    once()  # compile
    return statistics.median(once() for _ in range(repeats))


FORWARD = {"where": lambda path: path == "scan[0]"}  # (without backward=True the backward loop is scan[1])
ARMS = [
    ("untapped", None),
    ("forward only, whole carry", FORWARD),
    ("backward=True, whole carry", {"backward": True}),
    ("forward only, select=lambda _: ()", {**FORWARD, "select": lambda _: ()}),
    ("backward=True, progress idiom select=lambda _: ()", {"backward": True, "select": lambda _: ()}),
    ("forward only, flush_every=100", {**FORWARD, "flush_every": 100}),
    ("backward=True, flush_every=100", {"backward": True, "flush_every": 100}),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "backward.json"))
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.repeats = 200, 2
    args = (jnp.float32(1.3), jnp.linspace(0.1, 0.9, a.size, dtype=jnp.float32))
    fn = make_loss(a.steps)
    floor_s = timeit(make_loss(a.steps, raw=True), args, a.repeats, None)
    base = None
    rows = []
    for name, cfg in ARMS:
        t = timeit(fn, args, a.repeats, cfg)
        base = t if base is None else base
        rows.append({"arm": name, "s": t})
    floor = (floor_s - base) / a.steps
    fwd = {r["arm"]: r["s"] for r in rows}
    print(f"{a.steps} steps, carry {a.size} float32, jit(grad); hop floor {floor * 1e6:.1f} us/step "
          f"(raw jax.debug.callback, forward loop)")
    print(f"{'arm':52s} {'ms/call':>9s} {'extra us/step':>14s} {'x floor':>8s} {'backward only x floor':>22s}")
    for r in rows:
        extra = (r["s"] - base) / a.steps
        r["extra_us_per_step"] = extra * 1e6
        r["x_floor"] = extra / floor if floor > 0 else None
        ref = ("forward only, flush_every=100" if "flush_every" in r["arm"] else
               "forward only, select=lambda _: ()" if "select" in r["arm"] else "forward only, whole carry")
        back = (r["s"] - fwd[ref]) / a.steps if r["arm"].startswith("backward") else None
        r["backward_only_x_floor"] = None if back is None or floor <= 0 else back / floor
        bo = r["backward_only_x_floor"]
        print(f"{r['arm']:52s} {r['s'] * 1e3:9.2f} {extra * 1e6:14.2f} {r['x_floor'] or 0:8.2f} "
              f"{'' if bo is None else f'{bo:.2f}':>22s}")
    meta = {"jax": jax.__version__, "python": sys.version.split()[0], "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "steps": a.steps, "size": a.size, "repeats": a.repeats,
            "floor_us_per_step": floor * 1e6, "date": time.strftime("%Y-%m-%d")}
    if not a.smoke:
        with open(a.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
