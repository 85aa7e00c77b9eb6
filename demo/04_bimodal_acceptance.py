"""04 - The acceptance rate that was on target, and bimodal.

The story: HMC warmup on Neal's funnel (a log-scale v ~ N(0, 3) and five
coordinates x_i ~ N(0, exp(v/2))), in the centered parameterization, with a
Robbins-Monro step-size controller aiming at an average acceptance of 0.8.
The controller does its job: the run reports a mean acceptance of 0.79
(a running average kept in the carry). What
the mean hides is that there are two populations of steps - in the funnel's
wide mouth almost every trajectory is accepted, in its narrow neck the
step size is far too large, the trajectories diverge and acceptance is ~0.
The average of "always" and "never" is 0.8.

jax-tap: the carry is streamed every step with `select` picking two scalars
(v and the step's acceptance), `max_depth=0` so the leapfrog `fori_loop`
inside the step stays untapped. A text histogram of the stream shows the two
clusters, and splitting by v shows where the zeros come from. The fix (the
non-centered parameterization) gives the same mean with one cluster; checks
compare both histograms and the bitwise identity of the tapped run.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

D, N_STEPS, TARGET = 6, 3000, 0.8


def funnel_centered(q):
    v, x = q[0], q[1:]
    return -v**2 / 18.0 - 0.5 * jnp.sum(x**2) * jnp.exp(-v) - 0.5 * (D - 1) * v


def funnel_noncentered(q):  # the fix: sample z = x * exp(-v/2) instead of x
    return -q[0] ** 2 / 18.0 - 0.5 * jnp.sum(q[1:] ** 2)


def hmc_warmup(key, q0, logp, n_leap=10):
    """The user's HMC with a step-size controller. No logging lines."""
    grad = jax.grad(logp)

    def step(carry, inp):
        i, k = inp
        q, log_eps, _, avg = carry
        eps = jnp.exp(log_eps)
        k1, k2 = jax.random.split(k)
        p0 = jax.random.normal(k1, q.shape)

        def leapfrog(_, s):
            q1, p1 = s
            p1 = p1 + 0.5 * eps * grad(q1)
            q1 = q1 + eps * p1
            return q1, p1 + 0.5 * eps * grad(q1)

        q1, p1 = jax.lax.fori_loop(0, n_leap, leapfrog, (q, p0))
        h0, h1 = -logp(q) + 0.5 * p0 @ p0, -logp(q1) + 0.5 * p1 @ p1
        acc = jnp.where(jnp.isfinite(h1), jnp.minimum(1.0, jnp.exp(h0 - h1)), 0.0)
        q = jnp.where(jax.random.uniform(k2) < acc, q1, q)
        log_eps = log_eps + (acc - TARGET) / (i + 10.0) ** 0.6   # the controller
        avg = avg + (acc - avg) / (i + 1.0)                       # what the user reports
        return (q, log_eps, acc, avg), None

    init = (q0, jnp.float32(-1.0), jnp.float32(0.0), jnp.float32(0.0))
    return jax.lax.scan(step, init, (jnp.arange(N_STEPS), jax.random.split(key, N_STEPS)))[0]


def text_histogram(a, bins=10, width=50):
    counts, edges = np.histogram(a, bins=bins, range=(0.0, 1.0))
    for c, lo, hi in zip(counts, edges[:-1], edges[1:]):
        print(f"    {lo:.1f}-{hi:.1f} |{'#' * int(round(width * c / counts.max())):<{width}}| {c}")
    return counts


def stream(run, logp, key, q0):
    # carry leaves: (q, log_eps, acc, avg); ship q[0] (= v) and this step's acceptance
    with tap.record(select=lambda leaves: (leaves[0][0], leaves[2]), max_depth=0) as rec:
        out = run(key, q0, logp)
    v = np.array([e.value[0] for e in rec.events])
    acc = np.array([e.value[1] for e in rec.events])
    return out, rec, v, acc


def main():
    sys.stdout.reconfigure(line_buffering=True)
    run = jax.jit(hmc_warmup, static_argnums=2)
    key, q0 = jax.random.key(0), jnp.ones(D)
    expected = jax.block_until_ready(run(key, q0, funnel_centered))
    mean_acc = float(expected[3])
    print(f"warmup done: mean acceptance {mean_acc:.3f} (target {TARGET}), "
          f"step size {float(jnp.exp(expected[1])):.3f}  <- on target")

    out, rec, v, acc = stream(run, funnel_centered, key, q0)
    print(f"jax-tap: {len(rec.events)} events from {sorted({e.path for e in rec.events})}; "
          "per-step acceptance:")
    counts = text_histogram(acc)
    low, high = acc < 0.1, acc > 0.9
    print(f"  {low.mean():.0%} of steps accept (almost) nothing, {high.mean():.0%} (almost) everything; "
          f"mean v there: {v[low].mean():+.2f} vs {v[high].mean():+.2f}  (the neck vs the mouth)")
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)))
    consistent = abs(acc.mean() - mean_acc) < 1e-3 and acc[-1] == expected[2]
    print(f"tapped result bitwise identical to the untapped one: {same}; "
          f"stream consistent with the returned state (mean {acc.mean():.4f}, last step): {consistent}")

    print("fix - non-centered funnel, same controller:")
    _, _, _, acc_nc = stream(run, funnel_noncentered, key, q0)
    text_histogram(acc_nc)
    print(f"  mean acceptance {acc_nc.mean():.3f}; steps accepting (almost) nothing: {(acc_nc < 0.1).mean():.1%}")

    ok = (same and consistent and len(rec.events) == N_STEPS and abs(mean_acc - TARGET) < 0.05
          and low.mean() > 0.05 and high.mean() > 0.5 and counts[0] > counts[1:6].max()
          and v[low].mean() < v[high].mean() - 1.0
          and abs(acc_nc.mean() - TARGET) < 0.05 and (acc_nc < 0.1).mean() < low.mean() / 5)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
