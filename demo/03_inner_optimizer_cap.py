"""03 - The inner optimizer that quietly gave up.

The story: a Laplace-approximation filter for Poisson counts. Each time
step (an outer `lax.scan`) finds the mode of the log-posterior of the log
rate with gradient ascent in a `lax.while_loop`: a fixed learning rate, the
step clipped to +-0.2 "for safety", and a cap of 25 iterations. While counts
are low this converges in a handful of iterations. When the counts jump, the
curvature grows past what the learning rate can take: the iterate starts
bouncing across the mode, the clip keeps it bounded, and the loop simply
runs out of iterations and returns whichever side of the mode it stopped on.
No NaN, no warning, a plausible-looking rate estimate.

jax-tap: `where=lambda p: p == "scan[0]/while[0]"` taps only the inner
loop. Its events restart at step 0 for every outer step, so the last event
of each run is the solver's exit state (iterations, estimate, gradient):
the outer steps that hit the cap, with their leftover gradient, are listed.
Checks: the exit estimates streamed are bitwise the ones the filter
returned; the result is bitwise the untapped one; with a smaller learning
step scaled by the curvature (Newton) no solve hits the cap.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

MAX_ITER, TOL, Q = 25, 1e-4, 0.05


def poisson_filter(ys, m0, v0, lr=0.1, newton=False):
    """The user's filter: returns the filtered log rates. No logging lines."""

    def update(carry, y):
        m, v = carry

        def grad(th):
            return -(th - m) / v + y - jnp.exp(th)

        def not_done(s):
            i, th, g = s
            return (i < MAX_ITER) & (jnp.abs(g) > TOL)

        def ascend(s):
            i, th, g = s
            scale = 1.0 / (1.0 / v + jnp.exp(th)) if newton else lr  # the fix: divide by the curvature
            th = th + jnp.clip(scale * g, -0.2, 0.2)
            return i + 1, th, grad(th)

        _, th, _ = jax.lax.while_loop(not_done, ascend, (0, m, grad(m)))
        v_post = 1.0 / (1.0 / v + jnp.exp(th))
        return (th, v_post + Q), th

    return jax.lax.scan(update, (m0, v0), ys)[1]


def exit_states(events):
    """The inner loop's steps restart at 0 for each outer step: keep the last event of each run."""
    runs = []
    for e in events:
        if e.step == 0:
            runs.append(None)
        runs[-1] = e
    return runs


def main():
    sys.stdout.reconfigure(line_buffering=True)
    rate = np.concatenate([np.full(20, 3.0), np.full(20, 0.05), np.full(20, 12.0)])
    ys = jnp.asarray(np.random.default_rng(0).poisson(rate), jnp.float32)
    args = (ys, jnp.float32(0.0), jnp.float32(1.0))
    run = jax.jit(poisson_filter, static_argnames="newton")
    expected = jax.block_until_ready(run(*args))
    est = np.exp(np.asarray(expected))
    print(f"filter done: {len(ys)} steps, all finite: {bool(np.isfinite(est).all())}, "
          f"rate estimates for the last 5 steps: {np.round(est[-5:], 2)}  <- plausible")

    with tap.record(where=lambda p: p == "scan[0]/while[0]") as rec:
        observed = run(*args)  # unmodified; select=None: all three inner-loop leaves cross
    paths = {e.path for e in rec.events}
    exits = exit_states(rec.events)
    capped = [t for t, e in enumerate(exits) if int(e.value[0]) >= MAX_ITER]
    print(f"jax-tap: {len(rec.events)} inner-loop events from {paths}, {len(exits)} solves")
    print(f"solves that hit the {MAX_ITER}-iteration cap: {len(capped)}, at outer steps {capped}")
    for t in capped[:4]:
        i, th, g = exits[t].value
        print(f"  step {t}: y={float(ys[t]):4.0f}  exit after {int(i)} iterations, |gradient| = {abs(float(g)):.3g} "
              f"(tolerance {TOL:g}), rate estimate {float(np.exp(th)):.2f}")
    iters = [int(e.value[0]) for e in exits]
    print(f"iterations per solve, low counts vs high counts: median {np.median(iters[20:40]):.0f} vs "
          f"{np.median(iters[40:]):.0f}")

    same = np.asarray(observed).tobytes() == np.asarray(expected).tobytes()
    exit_theta = np.array([e.value[1] for e in exits], dtype=np.float32)
    agrees = exit_theta.tobytes() == np.asarray(expected).tobytes()
    print(f"tapped result bitwise identical to the untapped one: {same}; "
          f"streamed exit estimates == the filter's output (bitwise): {agrees}")

    with tap.record(where=lambda p: p == "scan[0]/while[0]") as rec_fix:
        run(*args, newton=True)
    fix_exits = exit_states(rec_fix.events)
    fix_capped = [t for t, e in enumerate(fix_exits) if int(e.value[0]) >= MAX_ITER]
    worst = max(abs(float(e.value[2])) for e in fix_exits)
    print(f"fix (Newton-scaled steps): {len(fix_capped)} solves hit the cap; worst exit |gradient| {worst:.2g}")

    ok = (same and agrees and paths == {"scan[0]/while[0]"} and len(exits) == len(ys) and len(capped) >= 5
          and all(abs(float(exits[t].value[2])) > TOL for t in capped) and not fix_capped
          and len(fix_exits) == len(ys) and worst <= TOL)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
