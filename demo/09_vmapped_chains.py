"""09 - Eight vmapped chains, one of them dead.

The story: eight random-walk Metropolis chains, `jax.vmap`-ed, sample a
Gamma(3, 1) scale parameter. The inits are "over-dispersed" by hand and one
of them is negative. There, log(x) is NaN, and `log(u) < NaN - NaN` is
False forever: that chain rejects every proposal and sits at its init for
the whole run. Nothing fails; the pooled posterior mean comes out 15% low
and the overall acceptance rate is only a bit lower than usual.

jax-tap, two ways to watch the same vmapped program, unmodified:
  * progress: `select=lambda _: ()` ships only the step counter, which is
    not batched, so one event per sampled step arrives, not eight;
  * per-chain telemetry: a select on a batched carry leaf (the acceptance
    counter) is delivered per lane: eight events per sampled step. We count
    events and look at the values (not at any lane field): one chain's
    counter is stuck at 0, and a live `alert=` says so mid-run.
Checks: the event counts; the streamed counters equal the ones recomputed
from the returned traces; results bitwise identical; positive inits fix it.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

N_CHAINS, N_STEPS, EVERY = 8, 500, 100


def logdensity(x):  # Gamma(3, 1), up to a constant
    return 2.0 * jnp.log(x) - x


def chain(key, x0):
    """The user's single-chain sampler. No logging lines."""

    def step(carry, k):
        x, lp, n_acc = carry
        k1, k2 = jax.random.split(k)
        y = x + 0.8 * jax.random.normal(k1)
        lp_y = logdensity(y)
        accept = jnp.log(jax.random.uniform(k2)) < lp_y - lp
        x, lp = jnp.where(accept, y, x), jnp.where(accept, lp_y, lp)
        return (x, lp, n_acc + accept), x

    return jax.lax.scan(step, (x0, logdensity(x0), 0), jax.random.split(key, N_STEPS))


def main():
    sys.stdout.reconfigure(line_buffering=True)
    keys = jax.random.split(jax.random.key(0), N_CHAINS)
    inits = jnp.array([1.5, 2.0, 0.7, 3.1, 2.5, -0.3, 1.1, 4.0])   # "over-dispersed", one negative
    run = jax.jit(jax.vmap(chain))
    expected = jax.block_until_ready(run(keys, inits))
    (_, _, n_acc), traces = expected
    print(f"8 chains x {N_STEPS} steps: pooled mean {float(traces.mean()):.2f} (true 3.00), "
          f"overall acceptance {float(n_acc.sum()) / (N_CHAINS * N_STEPS):.0%}  <- a bit off, nothing alarming")

    # 1) One progress display for all eight chains: only the (unbatched) step crosses.
    with tap.record(select=lambda _: (), sample_every=EVERY,
                    on_step=lambda e: sys.stderr.write(f"\r[live] step {e.step + 1}/{e.total}")) as prog:
        run(keys, inits)
    sys.stderr.write("\n")
    print(f"progress: {len(prog.events)} events for {N_STEPS // EVERY} sampled steps x {N_CHAINS} chains "
          "(one per step: the step counter is not batched)")

    # 2) Per-chain telemetry: the acceptance counter is batched, so each lane delivers its own event.
    def dead_chain(e):
        return f"a chain has accepted nothing in {e.step + 1} steps" if e.step > 0 and int(e.value) == 0 else False

    with tap.record(select=lambda leaves: leaves[2], sample_every=EVERY, alert=dead_chain, alert_once=True) as rec:
        observed = run(keys, inits)
    by_step = {}
    for e in rec.events:
        by_step.setdefault(e.step, []).append(int(e.value))
    print(f"per-chain: {len(rec.events)} events, {sorted({len(v) for v in by_step.values()})} per sampled step")
    for s, counts in by_step.items():
        print(f"  step {s:3d}: acceptance counters (sorted) {sorted(counts)}")

    # Cross-check: a chain accepted at step t iff its trace moved (x_t != x_{t-1}).
    tr = np.asarray(traces)
    moved = np.concatenate([tr[:, :1] != np.asarray(inits)[:, None], tr[:, 1:] != tr[:, :-1]], axis=1)
    recomputed = {s: sorted(moved[:, : s + 1].sum(axis=1).tolist()) for s in by_step}
    agrees = all(sorted(by_step[s]) == recomputed[s] for s in by_step)
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree_util.tree_leaves(observed), jax.tree_util.tree_leaves(expected)))
    stuck = [i for i in range(N_CHAINS) if int(n_acc[i]) == 0]
    print(f"streamed counters == recomputed from the traces: {agrees}; bitwise identical: {same}")
    print(f"the stuck chain (from the returned state): {stuck}, init {[round(float(inits[i]), 2) for i in stuck]} "
          f"-> log-density {[float(logdensity(inits[i])) for i in stuck]}")

    fixed_inits = jnp.abs(inits)
    (_, _, n_fix), tr_fix = run(keys, fixed_inits)
    print(f"fix (positive inits): pooled mean {float(tr_fix.mean()):.2f}, chains with no acceptance: "
          f"{int((n_fix == 0).sum())}")

    ok = (same and agrees and len(prog.events) == N_STEPS // EVERY and len(rec.events) == N_CHAINS * N_STEPS // EVERY
          and all(len(v) == N_CHAINS for v in by_step.values()) and all(sorted(v)[0] == 0 for v in by_step.values())
          and all(sorted(v)[1] > 0 for s, v in by_step.items() if s > 0) and stuck == [5]
          and int((n_fix == 0).sum()) == 0 and abs(float(tr_fix.mean()) - 3.0) < abs(float(traces.mean()) - 3.0))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
