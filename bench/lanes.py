"""A wide vmap under the lens: one hop per step carries every lane, and each
lane is one event.

    python bench/lanes.py                 # 1,000 lanes x 100 steps, scan and while loop
    python bench/lanes.py --lanes 100000  # wider

Arms, each timed warm (the median of 5 calls, after one first call) in one
process: the bare program; ``tap.record()`` with a recorder alone (which
keeps a hop's lanes as one block and builds the events when read);
the same, buffered (``flush_every=10``); and ``on_step`` consumers (every
lane's event built on the host while running). Reports µs per lane-event
above bare, and the time to read the recorder's events back.
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap


def program(kind, steps):
    def one(x):
        if kind == "scan":
            return jax.lax.scan(lambda c, _: (c * 0.99 + 1.0, None), x, None, length=steps)[0]
        # lanes run different numbers of steps: finished lanes emit nothing
        limit = steps // 2 + (x[0] > 0.5) * (steps - steps // 2)
        return jax.lax.while_loop(lambda s: s[1] < limit, lambda s: (s[0] * 0.99 + 1.0, s[1] + 1), (x, 0))[0]
    return jax.jit(jax.vmap(one))


def timed(f, x, cfg, repeats):
    """Median warm seconds of one call of ``f(x)`` inside a with-block of ``cfg``
    (None: no with-block), and the last recorder."""
    times, rec = [], None
    for i in range(repeats + 1):
        if cfg is None:
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            dt = time.perf_counter() - t0
        else:
            with tap.record(**cfg) as rec:
                t0 = time.perf_counter()
                jax.block_until_ready(f(x))
                jax.effects_barrier()
                dt = time.perf_counter() - t0
        if i:  # the first call compiles
            times.append(dt)
    return statistics.median(times), rec


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lanes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    x = jnp.linspace(0.0, 1.0, args.lanes)[:, None] * jnp.ones((1, 3))
    print(f"jax-tap lanes benchmark: {args.lanes} lanes x {args.steps} steps, jax {jax.__version__}")
    arms = {
        "record(), recorder alone": {},
        "record(flush_every=10), recorder alone": {"flush_every": 10},
        "record(on_step=...), events built per lane": {"on_step": lambda e: None},
        "record(flush_every=10, on_step=...)": {"flush_every": 10, "on_step": lambda e: None},
    }
    for kind in ("scan", "while"):
        f = program(kind, args.steps)
        bare, _ = timed(f, x, None, args.repeats)
        print(f"  {kind}: bare {bare * 1e3:.2f} ms")
        for name, cfg in arms.items():
            t, rec = timed(f, x, cfg, args.repeats)
            n = len(rec)
            t0 = time.perf_counter()
            rec.events
            read = time.perf_counter() - t0
            print(f"    {name:44s} {t * 1e3:8.1f} ms  {(t - bare) / n * 1e6:6.3f} us/event above bare"
                  f"  ({n} events; reading them back {read / n * 1e6:.2f} us/event)")


if __name__ == "__main__":
    main()
