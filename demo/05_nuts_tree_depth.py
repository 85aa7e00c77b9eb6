"""05 - NUTS silently saturating its maximum tree depth.

The story: a (toy) No-U-Turn sampler - each draw doubles a leapfrog
trajectory in a random direction until it makes a U-turn or reaches
MAX_DEPTH doublings, then picks a state along it (multinomial via Gumbel-max)
- on a 4-D Gaussian whose scales differ by 30x, run with the identity metric.
The leapfrog step size must respect the narrow direction, so along the wide
one the trajectory would need ~500 steps to turn around; with MAX_DEPTH = 8
(256 steps) it never turns. Nothing warns: every draw is valid, the chain
moves, the means look fine. Each draw just costs the maximum, and the wide
direction is explored by truncated trajectories.

jax-tap: one stream of the outer scan's carry, one int per draw (the tree
depth), feeds both a live tripwire - `alert=` prints a `[tap] FAIL` line at
the first saturated draw, while the sampler is still running - and, after
the run, `rec.df()` for the statistics. The fix (a diagonal metric matching
the scales) brings the depth down; checks cover both, the liveness of the
alert and the bitwise identity of the tapped run.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

MAX_DEPTH, EPS, N_DRAWS = 8, 0.2, 300
SCALES = jnp.array([30.0, 30.0, 30.0, 1.0])


def logdensity(q):
    return -0.5 * jnp.sum((q / SCALES) ** 2)


def nuts(key, q0, inv_metric):
    """The user's toy NUTS. No logging lines."""
    grad = jax.grad(logdensity)

    def draw(carry, key):
        q, _ = carry
        kp, kd, kg = jax.random.split(key, 3)
        p = jax.random.normal(kp, q.shape) / jnp.sqrt(inv_metric)
        score0 = logdensity(q) - 0.5 * jnp.sum(inv_metric * p**2)
        # tree: (q_left, p_left, q_right, p_right, best_q, best_score, depth, turned)
        init = (q, p, q, p, q, score0 + jax.random.gumbel(kg), 0, False)

        def not_done(t):
            return (t[6] < MAX_DEPTH) & ~t[7]

        def double(t):
            ql, pl, qr, pr, best_q, best, depth, _ = t
            go_right = jax.random.bernoulli(jax.random.fold_in(kd, depth))
            d = jnp.where(go_right, 1.0, -1.0)

            def leapfrog(i, s):
                q1, p1, bq, bs = s
                p1 = p1 + 0.5 * d * EPS * grad(q1)
                q1 = q1 + d * EPS * inv_metric * p1
                p1 = p1 + 0.5 * d * EPS * grad(q1)
                sc = logdensity(q1) - 0.5 * jnp.sum(inv_metric * p1**2)
                sc = sc + jax.random.gumbel(jax.random.fold_in(kg, 2**depth + i))
                return q1, p1, jnp.where(sc > bs, q1, bq), jnp.maximum(sc, bs)

            start = (jnp.where(go_right, qr, ql), jnp.where(go_right, pr, pl), best_q, best)
            q1, p1, best_q, best = jax.lax.fori_loop(0, 2**depth, leapfrog, start)
            ql, pl = jnp.where(go_right, ql, q1), jnp.where(go_right, pl, p1)
            qr, pr = jnp.where(go_right, q1, qr), jnp.where(go_right, p1, pr)
            dq = qr - ql
            turned = (dq @ (inv_metric * pl) < 0) | (dq @ (inv_metric * pr) < 0)
            return ql, pl, qr, pr, best_q, best, depth + 1, turned

        t = jax.lax.while_loop(not_done, double, init)
        return (t[4], t[6]), t[4]

    return jax.lax.scan(draw, (q0, 0), jax.random.split(key, N_DRAWS))


def main():
    sys.stdout.reconfigure(line_buffering=True)
    run = jax.jit(nuts)
    key, q0, identity = jax.random.key(0), jnp.zeros(4), jnp.ones(4)
    t0 = time.monotonic()
    expected = jax.block_until_ready(run(key, q0, identity))
    draws = np.asarray(expected[1])
    print(f"sampling done in {time.monotonic() - t0:.1f} s: {N_DRAWS} draws, all finite: "
          f"{bool(np.isfinite(draws).all())}, sd / true sd = {np.round(draws.std(0) / np.asarray(SCALES), 2)}"
          "  <- nothing to see")

    first_alert = []

    def saturated(e):
        if int(e.value) >= MAX_DEPTH:
            first_alert.append((time.monotonic(), e.step))
            return f"tree depth {int(e.value)} = MAX_DEPTH: the trajectory never turned"
        return False

    # the outer draw loop's carry is (q, depth): one int crosses per draw
    with tap.record(select=lambda leaves: leaves[1], where=lambda p: p == "scan[0]",
                    alert=saturated, alert_once=True) as rec:
        observed = jax.block_until_ready(run(key, q0, identity))
        t_done = time.monotonic()
    df = rec.df()
    frac = float((df["value"] == MAX_DEPTH).mean())
    live = bool(first_alert) and first_alert[0][0] < t_done
    print(f"jax-tap: {len(df)} rows in rec.df(); tripwire first fired at draw {first_alert[0][1]}, "
          f"{t_done - first_alert[0][0]:.2f} s before the sampler returned" if first_alert else "no alert")
    print(f"tree depth per draw: {df['value'].value_counts().sort_index().to_dict()}")
    cost = df["value"].map(lambda d: 2**d - 1).mean()
    print(f"  saturated: {frac:.0%} of draws; leapfrog steps per draw ~ {cost:.0f}")
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree_util.tree_leaves(observed), jax.tree_util.tree_leaves(expected)))
    print(f"tapped result bitwise identical to the untapped one: {same}")

    with tap.record(select=lambda leaves: leaves[1], where=lambda p: p == "scan[0]") as rec_fix:
        run(key, q0, SCALES**2)       # the fix: a diagonal metric = the target's variances
    df_fix = rec_fix.df()
    print(f"fix (diagonal metric): tree depths {df_fix['value'].value_counts().sort_index().to_dict()}, "
          f"saturated {float((df_fix['value'] == MAX_DEPTH).mean()):.0%}")

    ok = (same and live and len(df) == N_DRAWS and list(df.columns) == ["path", "step", "value"]
          and frac > 0.9 and df["step"].tolist() == list(range(N_DRAWS))
          and int(df["value"].iloc[-1]) == int(expected[0][1])
          and len(df_fix) == N_DRAWS and float((df_fix["value"] == MAX_DEPTH).mean()) == 0.0
          and df_fix["value"].mean() < MAX_DEPTH - 3)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
