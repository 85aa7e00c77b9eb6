"""A solver four loops deep, watched live without editing it.

The program: an outer annealing scan; each step runs a damped Newton solve
(a while loop) whose inner line search is another while loop. Its tolerance
(3e-8) is finer than float32 can resolve at some temperatures, so there the
Newton iteration silently burns its whole budget: the function "completes"
and returns plausible numbers.

jax-tap streams, while the compiled program runs:
  * a live progress line from the outer scan (the step counter only),
  * the exit state of every Newton solve (`where=` picks that one loop),
and prints which outer steps hit the iteration cap. The result is checked to
be bitwise identical to the untapped run. Ends with PASS or FAIL.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

MAX_NEWTON = 25
TOL = 3e-8


def anneal(x0, temps):
    """The user's code: no logging lines anywhere."""

    def residual(x, t):
        return jnp.tanh(3.0 * x) * t + x**3 - 0.5

    def newton_step(state, t):
        i, x, r = state
        g = jax.grad(lambda y: residual(y, t))(x)

        def shrink(ls):  # backtracking line search: while |r| does not drop
            k, a = ls
            return k + 1, a * 0.5

        def too_big(ls):
            k, a = ls
            return (k < 8) & (jnp.abs(residual(x - a * r / g, t)) > jnp.abs(r))

        _, a = jax.lax.while_loop(too_big, shrink, (0, jnp.float32(1.0)))
        x2 = x - a * r / g
        return i + 1, x2, residual(x2, t)

    def outer(x, t):
        def not_done(s):
            return (s[0] < MAX_NEWTON) & (jnp.abs(s[2]) > TOL)

        i, x2, r = jax.lax.while_loop(not_done, lambda s: newton_step(s, t), (0, x, residual(x, t)))
        return x2 * 0.9 + 0.05, (i, r)

    return jax.lax.scan(outer, x0, temps)


def main():
    temps = jnp.linspace(2.0, 0.2, 80).astype(jnp.float32)
    x0 = jnp.float32(0.3)
    run = jax.jit(anneal)
    expected = jax.block_until_ready(run(x0, temps))

    t0 = time.monotonic()
    first = []

    def progress(e):
        if e.path == "scan[0]":
            if not first:
                first.append(time.monotonic() - t0)
            done = e.step + 1
            bar = "#" * (30 * done // e.total)
            sys.stderr.write(f"\r[live] outer step {done:3d}/{e.total} [{bar:<30}]")
            time.sleep(0.01)  # a slow display, to show the stream is live

    newton_exits = []

    def newton(e):
        if e.path == "scan[0]/while[0]":
            newton_exits.append(e)

    with tap.record(on_step=lambda e: (progress(e), newton(e)),
                    select=lambda leaves, path: () if path == "scan[0]" else (leaves[0], leaves[2]),
                    where=lambda p: p in ("scan[0]", "scan[0]/while[0]")) as rec:
        observed = run(x0, temps)  # the same jitted function, unmodified
    sys.stderr.write("\n")

    # The last Newton event of each outer step is that solve's exit state.
    # (an outer step's Newton events arrive before that step's own event).
    exits, last = {}, None
    for e in rec.events:
        if e.path == "scan[0]/while[0]":
            last = e
        elif e.path == "scan[0]" and last is not None:
            exits[e.step], last = last, None
    capped = sorted(k for k, e in exits.items() if int(e.value[0]) >= MAX_NEWTON)
    print(f"events: {len(rec.events)} ({sum(e.path == 'scan[0]' for e in rec.events)} outer steps, "
          f"{len(newton_exits)} Newton iterations)")
    print(f"first event after {first[0] * 1e3:.0f} ms (the loop was still running)")
    print(f"Newton solves that hit the {MAX_NEWTON}-iteration cap at outer steps: {capped}")
    for k in capped[:3]:
        print(f"  step {k}: |residual| = {abs(float(exits[k].value[1])):.3g} after {int(exits[k].value[0])} iterations")

    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree_util.tree_leaves(observed), jax.tree_util.tree_leaves(expected)))
    print(f"tapped result bitwise identical to the untapped one: {same}")
    truth = [int(k) for k in np.nonzero(np.asarray(expected[1][0]) >= MAX_NEWTON)[0]]
    print(f"(cross-check: the iteration counts the program returns say {truth})")
    ok = same and bool(capped) and capped == truth and len(rec.events) > 80
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
