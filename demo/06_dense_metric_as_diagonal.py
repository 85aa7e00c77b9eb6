"""06 - A dense mass matrix, silently run as a diagonal one.

The story: an HMC kernel factory takes a config dict. The user estimated a
dense inverse mass matrix for a strongly correlated target (correlation
0.998) and asked for it with `"dense_mass": True` - but the factory reads
the key `"dense_metric"`, falls back to its default, and uses only the
diagonal of the matrix (all ones here: the identity). Nothing fails. The
step-size adaptation hits its 80% acceptance target, every draw is finite;
the step size is just tiny and the chain crawls along the long axis of the
target, which shows up, if at all, as a poor effective sample size later.

jax-tap: `tap.primitives(f, *args)` traces the function once (nothing runs)
and counts its primitives. Side by side, the kernel the user meant
(a dense metric: matrix-vector products in every leapfrog step) and the
kernel that runs differ by exactly the missing `dot_general`s - the bug is
visible before a single step executes. A runtime tap (`tap.on("dot_general")`
on a 5-step run of each kernel) agrees: the leapfrog loop of the kernel that
runs is missing the product inv_metric @ p. Checks: those counts, the fixed chain's
mixing, and the bitwise identity of the tapped short runs.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

N_STEPS, N_LEAP = 1000, 8
COV = jnp.array([[1.0, 0.998, 0.0], [0.998, 1.0, 0.0], [0.0, 0.0, 1.0]])
PREC = jnp.linalg.inv(COV)


def logdensity(q):
    return -0.5 * q @ PREC @ q


def make_hmc(config):
    """The library's kernel factory (reads `dense_metric`, not `dense_mass`)."""
    inv_metric = config["inv_metric"]
    if config.get("dense_metric", False):
        chol = jnp.linalg.cholesky(jnp.linalg.inv(inv_metric))
        draw_p = lambda k, q: chol @ jax.random.normal(k, q.shape)  # noqa: E731
        velocity = lambda p: inv_metric @ p  # noqa: E731
    else:
        diag = jnp.diag(inv_metric)
        draw_p = lambda k, q: jax.random.normal(k, q.shape) / jnp.sqrt(diag)  # noqa: E731
        velocity = lambda p: diag * p  # noqa: E731
    grad = jax.grad(logdensity)

    def sample(key, q0, n_steps=N_STEPS):
        def step(carry, inp):
            i, k = inp
            q, log_eps = carry
            eps = jnp.exp(log_eps)
            k1, k2 = jax.random.split(k)
            p0 = draw_p(k1, q)

            def leapfrog(_, s):
                q1, p1 = s
                p1 = p1 + 0.5 * eps * grad(q1)
                q1 = q1 + eps * velocity(p1)
                return q1, p1 + 0.5 * eps * grad(q1)

            q1, p1 = jax.lax.fori_loop(0, N_LEAP, leapfrog, (q, p0))
            log_acc = logdensity(q1) - 0.5 * p1 @ velocity(p1) - logdensity(q) + 0.5 * p0 @ velocity(p0)
            p_acc = jnp.minimum(1.0, jnp.exp(log_acc))
            q = jnp.where(jax.random.uniform(k2) < p_acc, q1, q)
            log_eps = log_eps + (p_acc - 0.8) / (i + 10.0) ** 0.6   # step-size adaptation
            return (q, log_eps), (q, p_acc)

        steps = (jnp.arange(n_steps), jax.random.split(key, n_steps))
        (_, log_eps), (draws, p_acc) = jax.lax.scan(step, (q0, jnp.float32(-1.0)), steps)
        return draws, p_acc, jnp.exp(log_eps)

    return sample


def lag1(x):
    x = x - x.mean()
    return float((x[1:] * x[:-1]).mean() / (x * x).mean())


def leapfrog_dot_sites(kernel, key, q0):
    """Run 5 steps with every dot_general tapped; count sites in the leapfrog loop."""
    with tap.record(ops=(), taps=[tap.on("dot_general", select=lambda outs: ())]) as rec:
        out = jax.jit(kernel, static_argnums=2)(key, q0, 5)
    clean = jax.jit(kernel, static_argnums=2)(key, q0, 5)
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(clean)))
    in_loops = all(e.path.startswith("scan[0]/") for e in rec.events)   # no dot_general outside the loop
    return len({e.path for e in rec.events if e.path.startswith("scan[0]/scan[0]/")}), same and in_loops


def main():
    sys.stdout.reconfigure(line_buffering=True)
    key, q0 = jax.random.key(0), jnp.zeros(3)
    user_config = {"inv_metric": COV, "dense_mass": True}   # the user's intent, under the wrong key
    actual = make_hmc(user_config)
    draws, p_acc, eps = jax.block_until_ready(jax.jit(actual)(key, q0))
    long_axis = np.asarray(draws)[200:] @ np.array([1.0, 1.0, 0.0]) / np.sqrt(2.0)
    print(f"sampling done: acceptance {float(p_acc[200:].mean()):.0%} (target 80%), step size {float(eps):.3f}, "
          f"all finite: {bool(np.isfinite(draws).all())}  <- looks healthy")
    print(f"  (later, an ESS check: lag-1 autocorrelation along the target's long axis {lag1(long_axis):.3f})")

    intended = make_hmc({"inv_metric": COV, "dense_metric": True})
    p_actual, p_intended = tap.primitives(actual, key, q0), tap.primitives(intended, key, q0)
    print("tap.primitives (trace only, nothing runs):")
    print(f"  kernel that runs : dot_general={p_actual.get('dot_general', 0)}, mul={p_actual.get('mul', 0)}")
    print(f"  kernel meant     : dot_general={p_intended.get('dot_general', 0)}, mul={p_intended.get('mul', 0)}")
    diff = {k: p_intended.get(k, 0) - p_actual.get(k, 0) for k in sorted(set(p_actual) | set(p_intended))
            if p_intended.get(k, 0) != p_actual.get(k, 0)}
    print(f"  difference (meant - runs): {diff}")
    print(f"  -> the dense metric's matrix-vector products are missing: the config {sorted(user_config)} "
          "never reached the dense branch")

    n_actual, same_a = leapfrog_dot_sites(actual, key, q0)
    n_intended, same_i = leapfrog_dot_sites(intended, key, q0)
    print(f"runtime tap, dot_general sites firing in the leapfrog loop: runs {n_actual}, meant {n_intended}; "
          f"tapped results bitwise identical: {same_a and same_i}")

    fixed_draws, fixed_acc, fixed_eps = jax.jit(intended)(key, q0)
    fixed_long = np.asarray(fixed_draws)[200:] @ np.array([1.0, 1.0, 0.0]) / np.sqrt(2.0)
    print(f"fix (config key 'dense_metric'): acceptance {float(fixed_acc[200:].mean()):.0%}, step size "
          f"{float(fixed_eps):.2f}, lag-1 autocorrelation {lag1(fixed_long):.3f} (was {lag1(long_axis):.3f})")

    ok = (same_a and same_i and diff.get("dot_general", 0) >= 2 and n_intended == n_actual + 1
          and abs(float(p_acc[200:].mean()) - 0.8) < 0.05 and lag1(long_axis) > 0.9
          and lag1(fixed_long) < 0.5 and float(fixed_eps) > 5 * float(eps))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
