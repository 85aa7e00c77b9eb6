"""07 - Execution hidden as "compilation".

The story: a simulation step (a 512x512 matrix recurrence) runs 400 times in
a `lax.scan` under `jax.jit`. The user times the first call - well over a
second - files it under "JAX compile time", and plans a persistent
compilation cache. The first call of a jitted function is one opaque block
of wall time (trace + compile + execute), so the story is easy to believe.

jax-tap: the first loop event can only arrive once compilation is done and
the program has run its first step, so its arrival timestamp splits the
first call: everything before it is trace + compile (plus one step),
everything after it is execution. The progress idiom (`select=lambda _: ()`,
`sample_every=50`) ships only step counters. The split says the compile
part is small and the execution dominates - a compilation cache would not
help. Checks: both parts positive and summing to the total; the second
(cached) call takes about what the split predicted for execution; AOT
`lower().compile()` of the same function takes about what it predicted for
compilation; and the tapped result is bitwise the untapped one.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

N, STEPS = 512, 400


def simulate(W, X0):
    """The user's simulation. No logging lines."""

    def step(X, _):
        return jnp.tanh(W @ X) + 0.01 * X, None

    return jax.lax.scan(step, X0, None, length=STEPS)[0]


def main():
    sys.stdout.reconfigure(line_buffering=True)
    W = jax.random.normal(jax.random.key(0), (N, N)) / N**0.5
    X0 = jnp.ones((N, N))
    run = jax.jit(simulate)

    arrivals = []

    def on_step(e):
        arrivals.append((time.perf_counter(), e.step))
        sys.stderr.write(f"\r[live] step {e.step + 1:3d}/{e.total}")

    with tap.record(on_step=on_step, select=lambda _: (), sample_every=50) as rec:
        t0 = time.perf_counter()
        observed = jax.block_until_ready(run(W, X0))        # the first call: trace + compile + run
        t_end = time.perf_counter()
        sys.stderr.write("\n")
        t1 = time.perf_counter()
        jax.block_until_ready(run(W, X0))                   # second call: cached, execution only
        t_second = time.perf_counter() - t1
        sys.stderr.write("\n")
    total = t_end - t0
    first_arrival, first_step = arrivals[0]
    compile_part, exec_part = first_arrival - t0, t_end - first_arrival
    print(f"first call: {total:.2f} s wall  <- 'mostly compilation', one would think")
    print(f"jax-tap: first event (step {first_step}) arrived {compile_part:.2f} s after the call")
    print(f"  trace + compile (+ one step): {compile_part:.2f} s ({compile_part / total:.0%})")
    print(f"  execution                   : {exec_part:.2f} s ({exec_part / total:.0%})")

    # Cross-checks, independent of the tap.
    t2 = time.perf_counter()
    compiled = jax.jit(simulate).lower(W, X0).compile()    # a fresh jit object: compiles again
    aot = time.perf_counter() - t2
    expected = jax.block_until_ready(compiled(W, X0))
    print(f"second call (cached, tapped): {t_second:.2f} s vs the split's execution estimate {exec_part:.2f} s")
    print(f"AOT lower+compile (untapped): {aot:.2f} s vs the split's compile estimate {compile_part:.2f} s")
    same = np.asarray(observed).tobytes() == np.asarray(expected).tobytes()
    print(f"tapped result bitwise identical to the untapped one: {same}")
    print("-> a compilation cache would save at most the first part; the time is in the arithmetic.")

    steps = [e.step for e in rec.events]
    ok = (same and compile_part > 0 and exec_part > 0 and abs(compile_part + exec_part - total) < 1e-9
          and steps == list(range(0, STEPS, 50)) * 2 and exec_part > compile_part
          and 0.33 < t_second / exec_part < 3.0 and compile_part < 10 * aot + 0.5)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
