"""02 - The metric that never moved.

The story: a warmup for a preconditioned random-walk Metropolis sampler. It
adapts a step size (Robbins-Monro towards 23% acceptance) and, in windows of
500 steps, a dense inverse metric from a Welford covariance estimate. The
target is a correlated Gaussian whose covariance has condition number 400, so
a learned metric should make the proposal 20x longer in one direction than
in another.

The bug is two lines in the wrong order at the end of a window: the Welford
accumulator is reset *before* the metric is read from it, so every window
installs the regularizer of an empty estimate: the identity.
Nothing fails. The warmup "converges": the acceptance rate is on target and
the step size has settled - at the small value the narrowest direction allows.

jax-tap: a carry `select` computes, on device, the eigenvalue ratio of the
metric and of the running covariance estimate (two floats cross, not two
matrices), shipped every 250 steps (`sample_every`). The stream shows the
estimate learning the target's shape while the installed metric stays at
ratio 1.0: the information is gathered and thrown away. With the two lines
swapped the metric's ratio reaches the target's and the step size grows.
"""
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

DIM, N_STEPS, WINDOW = 4, 2000, 500
COV = jnp.diag(jnp.array([20.0, 1.0, 0.5, 0.05])).astype(jnp.float32)   # condition number 400
PREC = jnp.linalg.inv(COV)


class Adapt(NamedTuple):
    x: jax.Array
    log_step: jax.Array
    mean: jax.Array
    m2: jax.Array
    count: jax.Array
    inv_metric: jax.Array


def logdensity(x):
    return -0.5 * x @ PREC @ x


def end_window_buggy(st):
    """The user's window end: the accumulator is reset first (the bug)."""
    st = st._replace(mean=jnp.zeros_like(st.mean), m2=jnp.zeros_like(st.m2), count=jnp.zeros_like(st.count))
    n = st.count.astype(jnp.float32)
    cov = st.m2 / jnp.maximum(n - 1.0, 1.0)
    return st._replace(inv_metric=(n / (n + 5.0)) * cov + (5.0 / (n + 5.0)) * jnp.eye(DIM))


def end_window_fixed(st):
    """The same two statements in the right order."""
    n = st.count.astype(jnp.float32)
    cov = st.m2 / jnp.maximum(n - 1.0, 1.0)
    st = st._replace(inv_metric=(n / (n + 5.0)) * cov + (5.0 / (n + 5.0)) * jnp.eye(DIM))
    return st._replace(mean=jnp.zeros_like(st.mean), m2=jnp.zeros_like(st.m2), count=jnp.zeros_like(st.count))


def warmup(key, x0, end_window):
    """The user's adaptation loop. No logging lines."""

    def step(st, inp):
        i, k = inp
        k1, k2 = jax.random.split(k)
        L = jnp.linalg.cholesky(st.inv_metric)
        prop = st.x + jnp.exp(st.log_step) * L @ jax.random.normal(k1, (DIM,))
        p_acc = jnp.minimum(1.0, jnp.exp(logdensity(prop) - logdensity(st.x)))
        x = jnp.where(jax.random.uniform(k2) < p_acc, prop, st.x)
        log_step = st.log_step + (p_acc - 0.234) / jnp.sqrt(1.0 + (i % WINDOW))
        count = st.count + 1                                 # Welford update
        delta = x - st.mean
        mean = st.mean + delta / count
        st = Adapt(x, log_step, mean, st.m2 + jnp.outer(delta, x - mean), count, st.inv_metric)
        st = jax.lax.cond((i + 1) % WINDOW == 0, end_window, lambda s: s, st)
        return st, p_acc

    init = Adapt(x0, jnp.float32(0.0), jnp.zeros(DIM), jnp.zeros((DIM, DIM)), jnp.int32(0), jnp.eye(DIM))
    return jax.lax.scan(step, init, (jnp.arange(N_STEPS), jax.random.split(key, N_STEPS)))


def ratio(m):
    ev = jnp.linalg.eigvalsh(m)
    return ev[-1] / jnp.maximum(ev[0], 1e-30)


def shape_select(leaves):  # leaves follow Adapt's fields: x, log_step, mean, m2, count, inv_metric
    return {"metric_ratio": ratio(leaves[5]), "estimate_ratio": ratio(leaves[3] + 1e-6 * jnp.eye(DIM)),
            "step": jnp.exp(leaves[1])}


def main():
    sys.stdout.reconfigure(line_buffering=True)
    key, x0 = jax.random.key(1), jnp.ones(DIM)
    run = jax.jit(warmup, static_argnums=2)
    final, acc = jax.block_until_ready(run(key, x0, end_window_buggy))
    print(f"warmup done: acceptance {float(acc[-WINDOW:].mean()):.1%} (target 23.4%), "
          f"step size settled at {float(jnp.exp(final.log_step)):.3f}  <- looks converged")

    with tap.record(select=shape_select, sample_every=250) as rec:
        observed = run(key, x0, end_window_buggy)        # same jitted function, unmodified
    print(f"jax-tap, every 250 steps ({len(rec.events)} events; target condition number "
          f"{float(ratio(COV)):.0f}):")
    for e in rec.events:
        v = e.value
        print(f"  step {e.step:4d}: metric ratio {float(v['metric_ratio']):7.2f}   "
              f"covariance-estimate ratio {float(v['estimate_ratio']):7.1f}   step {float(v['step']):.3f}")
    metric_ratios = np.array([float(e.value["metric_ratio"]) for e in rec.events])
    est_ratios = np.array([float(e.value["estimate_ratio"]) for e in rec.events])
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree_util.tree_leaves(observed), jax.tree_util.tree_leaves((final, acc))))
    print(f"tapped result bitwise identical to the untapped one: {same}")

    with tap.record(select=shape_select, sample_every=250) as rec_fix:
        fixed, _ = run(key, x0, end_window_fixed)
    fixed_ratio = float(rec_fix.events[-1].value["metric_ratio"])

    def widest(st):  # proposal standard deviation along the target's widest axis
        return float(jnp.exp(st.log_step) * jnp.sqrt(jnp.linalg.eigvalsh(st.inv_metric)[-1]))

    print(f"fixed (metric read before the reset): metric ratio {fixed_ratio:.0f}; proposal sd along the "
          f"widest axis {widest(fixed):.2f} (was {widest(final):.2f}; target sd {float(jnp.sqrt(COV[0, 0])):.2f})")

    ok = (same and len(rec.events) == N_STEPS // 250 and np.allclose(metric_ratios, 1.0, atol=1e-3)
          and est_ratios.max() > 50 and fixed_ratio > 100 and widest(fixed) > 3 * widest(final))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
