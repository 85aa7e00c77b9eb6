"""01 - The float32 Cholesky trap: a sampler that "works" while half its
log-densities are NaN.

The story: a random-walk Metropolis sampler over the lengthscale of a
Gaussian-process model. The log marginal likelihood factors the kernel
matrix with `jnp.linalg.cholesky`, with a jitter of 1e-8 copied from a
float64 code base. JAX computes in float32 by default, where 1 + 1e-8 == 1:
once the lengthscale grows, the kernel matrix is numerically indefinite and
the Cholesky factor comes back full of NaN. Nothing raises. The Metropolis
test `log(u) < NaN` is simply False, so every such proposal is "rejected",
the run completes, every sample is finite - and the posterior is silently
truncated at the edge of float32's reach. The symptom a user sees is a low
acceptance rate, which they would blame on the proposal scale.

jax-tap: `tap.watch_nan("cholesky", once=True)` on the unmodified sampler
prints one live line naming the primitive's address and the first step, and
its recorder counts every step whose factor was non-finite. The fix (float64,
JAX_ENABLE_X64=1) is run in a subprocess and checked: no NaN, a healthy
acceptance rate, a different posterior.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

N_STEPS = 400
JITTER = 1e-8  # fine in float64, invisible in float32


def lengthscale_sampler(key, log_ell0, X, y):
    """The user's code: random-walk Metropolis on log(lengthscale). No logging."""

    def log_post(log_ell):
        ell = jnp.exp(log_ell)
        K = jnp.exp(-0.5 * (X[:, None] - X[None, :]) ** 2 / ell**2) + JITTER * jnp.eye(X.shape[0], dtype=X.dtype)
        L = jnp.linalg.cholesky(K)
        a = jax.scipy.linalg.solve_triangular(L, y, lower=True)
        lml = -0.5 * a @ a - jnp.log(jnp.diag(L)).sum()
        return lml - 0.5 * log_ell**2  # standard normal prior on log(lengthscale)

    def step(state, key):
        x, lp = state
        k1, k2 = jax.random.split(key)
        x_new = x + 0.5 * jax.random.normal(k1, dtype=x.dtype)
        lp_new = log_post(x_new)
        accept = jnp.log(jax.random.uniform(k2, dtype=x.dtype)) < lp_new - lp
        x, lp = jnp.where(accept, x_new, x), jnp.where(accept, lp_new, lp)
        return (x, lp), (x, accept)

    return jax.lax.scan(step, (log_ell0, log_post(log_ell0)), jax.random.split(key, N_STEPS))


def problem(dtype):
    X = jnp.linspace(0.0, 1.0, 8, dtype=dtype)
    return jax.random.key(0), dtype(-0.7), X, (0.5 * X + 0.1).astype(dtype)


def summary(out):
    (_, _), (trace, accepted) = out
    ell = np.exp(np.asarray(trace, dtype=np.float64))
    return {"acceptance": float(np.mean(accepted)), "ell_mean": float(ell.mean()), "ell_max": float(ell.max()),
            "all_finite": bool(np.isfinite(ell).all())}


def run_one(dtype, report=lambda s: None):
    args = problem(dtype)
    run = jax.jit(lengthscale_sampler)
    expected = jax.block_until_ready(run(*args))
    s = summary(expected)
    report(s)                       # the symptom, before any tap
    # The same jitted function, unmodified; ops=(): no carry events, only the NaN watch.
    with tap.record(ops=(), taps=[tap.watch_nan("cholesky", once=True)]) as rec:
        observed = jax.block_until_ready(run(*args))
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree_util.tree_leaves(observed), jax.tree_util.tree_leaves(expected)))
    nan_steps = sorted({e.step for e in rec.events if e.kind == "primitive"})
    return {**s, "nan_steps": nan_steps, "paths": sorted({e.path for e in rec.events}), "same": same}


def symptom(s):
    print(f"run completed: {N_STEPS} steps, all samples finite: {s['all_finite']}, "
          f"acceptance {s['acceptance']:.1%}, mean lengthscale {s['ell_mean']:.2f} (max {s['ell_max']:.2f})")
    print("  -> looks like a proposal-scale problem. The same call under tap.watch_nan:")


def main():
    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with jax-tap's live stderr lines
    if "--x64" in sys.argv:  # the fix, run by the parent in a float64 process
        print(json.dumps(run_one(jnp.float64)))
        return 0

    print("== float32 (JAX's default) ==")
    s32 = run_one(jnp.float32, report=symptom)
    print(f"jax-tap: the Cholesky factor was non-finite at {len(s32['nan_steps'])} of {N_STEPS} steps, "
          f"first at step {s32['nan_steps'][0] if s32['nan_steps'] else None}; address(es) {s32['paths']}")
    print(f"tapped result bitwise identical to the untapped one: {s32['same']}")

    print("== the fix: the same file in float64 (JAX_ENABLE_X64=1, subprocess) ==")
    env = dict(os.environ, JAX_ENABLE_X64="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--x64"], env=env,
                          capture_output=True, text=True, timeout=240)
    try:
        s64 = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        print(proc.stdout, proc.stderr)
        print("FAIL")
        return 1
    print(f"float64: acceptance {s64['acceptance']:.1%}, mean lengthscale {s64['ell_mean']:.2f} "
          f"(max {s64['ell_max']:.2f}), non-finite Cholesky steps: {len(s64['nan_steps'])}, "
          f"bitwise identical tapped: {s64['same']}")

    ok = (s32["same"] and s32["all_finite"] and len(s32["nan_steps"]) > N_STEPS // 10
          and s32["paths"] == ["scan[0]/jit[0]/cholesky[0]"]
          and s64["same"] and s64["nan_steps"] == [] and s64["acceptance"] > 4 * s32["acceptance"]
          and s64["ell_max"] > 2 * s32["ell_max"])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
