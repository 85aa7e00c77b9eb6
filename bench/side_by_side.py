"""jax-tap beside the tools users compare it with, on one loop, in one run.

    pip install -e ".[bench]"          # jax-tqdm and tqdm, the competitors (not dependencies)
    python bench/side_by_side.py       # 20,000-step scans, 7 repeats
    python bench/side_by_side.py --steps 2000 --repeats 3   # quick

Two jobs, each done by the other tools and by jax-tap, on the same jitted
scan as ``bench.py`` (``c * 0.999 + sin(x) * 0.01`` on a 4-vector):

* **A progress bar**: jax-tqdm's ``scan_tqdm`` (which needs the body
  rewritten: decorated, looping over ``jnp.arange(n)``) at its default
  rate (every n/20 steps) and every step, against jax-tap's progress
  recipe (README: ``select=lambda _: ()``, the bar moved from ``on_step``)
  at the same rates, and buffered (every step recorded, one hop per 1000).
* **A NaN watch**: ``checkify`` with its float checks (a NaN check after
  every float op, errors carried out of the loop; no event until the
  program returns) against ``tap.watch_nan`` on ``sin``'s output, on the
  carry, and a hand-written ``jax.debug.callback`` test every step.

Every bar writes to ``os.devnull``. Reported per arm: the median time per
step after a warm-up call, × the bare program, and the first call (trace,
compile, run). Timing assertions never live in the tests: read the ratios,
which compare arms of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxtap as tap  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import body, timeit  # noqa: E402  (the same loop and clock as bench.py)


def bare(c0, xs):
    return jax.lax.scan(body, c0, xs)[0]


def tqdm_bar(n, rate, devnull):
    """jax-tqdm's scan_tqdm: the body rewritten to loop over the step numbers."""
    from jax_tqdm import scan_tqdm

    @scan_tqdm(n, print_rate=rate, file=devnull)
    def step(c, ix):
        _, x = ix
        return body(c, x)

    def f(c0, xs):
        return jax.lax.scan(step, c0, (jnp.arange(n), xs))[0]
    return f


def tap_bar(n, every, devnull, flush_every=None):
    """jax-tap's progress recipe: the user's scan untouched, a tqdm bar moved
    from ``on_step`` (per event) or ``on_block`` (per buffered block)."""
    from tqdm import tqdm
    bar = tqdm(total=n, file=devnull)

    class Bar:
        def __call__(self, event):
            bar.update(every)

        def on_block(self, block):
            bar.update(len(block) * every)

    return tap.verbose(bare, on_step=Bar(), select=lambda _: (), sample_every=every, flush_every=flush_every)


def raw_nan_check(c0, xs):
    """What a user writes by hand: test the carry every step, on the host."""
    def check(i, bad):
        if bad:
            print(f"NaN at step {i}", file=sys.stderr)

    def b(carry, x):
        i, c = carry
        c2, _ = body(c, x)
        jax.debug.callback(check, i, jnp.isnan(c2).any())
        return (i + 1, c2), None
    return jax.lax.scan(b, (jnp.int32(0), c0), xs)[0][1]


def checkified(c0, xs):
    from jax.experimental import checkify
    return checkify.checkify(bare, errors=checkify.float_checks)(c0, xs)  # (err, out): err.throw() on the host


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "side_by_side.json"))
    a = ap.parse_args(argv)
    n, rate = a.steps, max(1, a.steps // 20)
    c0 = jnp.zeros((4,), jnp.float32)
    xs = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)[:, None] * jnp.ones((1, 4), jnp.float32)
    devnull = open(os.devnull, "w")
    import jax_tqdm
    versions = {"jax": jax.__version__, "jax-tap": tap.__version__, "jax-tqdm": getattr(jax_tqdm, "__version__", "?")}
    print(f"side by side: {n} steps, {a.repeats} repeats, {versions}, {platform.machine()}, {os.cpu_count()} cpus")
    rows = {}

    def arm(job, name, fn):
        first, t = timeit(jax.jit(fn), (c0, xs), a.repeats)
        rows[name] = {"job": job, "us_per_step": t / n * 1e6, "first_call_s": first}
        print(f"  {name:58s} {t / n * 1e6:9.3f} us/step  first call {first:6.2f} s", flush=True)

    arm("-", "bare", bare)
    arm("progress", f"jax-tqdm scan_tqdm, default rate (every {rate})", tqdm_bar(n, rate, devnull))
    arm("progress", f"jax-tap progress recipe, sample_every={rate}", tap_bar(n, rate, devnull))
    arm("progress", "jax-tqdm scan_tqdm, every step", tqdm_bar(n, 1, devnull))
    arm("progress", "jax-tap progress recipe, every step", tap_bar(n, 1, devnull))
    arm("progress", "jax-tap progress recipe, every step, flush_every=1000", tap_bar(n, 1, devnull, 1000))
    arm("nan", "checkify float_checks (errors read at the end)", checkified)
    arm("nan", "hand-written jax.debug.callback NaN test, every step", raw_nan_check)
    arm("nan", "jax-tap watch_nan('sin'), every step", tap.verbose(bare, taps=[tap.watch_nan("sin")]))
    arm("nan", "jax-tap carry alert (isnan(c).any() crosses), every step",
        tap.verbose(bare, select=lambda leaves: jnp.isnan(leaves[0]).any(), alert=lambda e: bool(e.value),
                    on_step=lambda e: None))
    b = rows["bare"]["us_per_step"]
    for r in rows.values():
        r["x_bare"] = r["us_per_step"] / b
    with open(a.out, "w") as fh:
        json.dump({"steps": n, "repeats": a.repeats, "versions": versions, "machine": platform.machine(),
                   "cpus": os.cpu_count(), "arms": rows}, fh, indent=1)
    print("\n| job | arm | µs / step | × bare | first call (s) |\n|---|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {r['job']} | {name} | {r['us_per_step']:.3g} | {r['x_bare']:.3g} | {r['first_call_s']:.2f} |")


if __name__ == "__main__":
    main()
