"""A real program under the lens: BlackJAX NUTS (window adaptation, then
sampling) and an optax Adam training loop, each arm in a fresh process so
that every arm pays its own first-call compilation.

    python bench/real_program.py            # all arms, 1 repeat each
    python bench/real_program.py --cache    # also: JAX's persistent compilation cache, warm, tapped vs not

Reports wall time per arm and its ratio to the plain program measured in the
same run. Needs the [test] extras (blackjax, optax).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ARMS = {
    "plain": None,
    "record() defaults": "",
    "record(select=lambda _: ())": "select=lambda _: ()",
    "record(flush_every=1000)": "flush_every=1000",
    "record(jit_events=True, ops=())": "jit_events=True, ops=()",
}


def program():
    """The workload (several loops, nesting: NUTS' while loops in a scan)."""
    import blackjax
    import jax
    import jax.numpy as jnp
    import optax

    def logdensity(p):
        x, s = p["x"], p["log_s"]
        return -0.5 * jnp.sum((x - 1.0) ** 2 / jnp.exp(2 * s)) - jnp.sum(s) - 0.5 * jnp.sum(s ** 2)

    key = jax.random.key(0)
    warm = blackjax.window_adaptation(blackjax.nuts, logdensity)
    (state, params), _ = warm.run(key, {"x": jnp.zeros(5), "log_s": jnp.zeros(5)}, num_steps=300)
    kernel = blackjax.nuts(logdensity, **params).step

    def one(st, k):
        st, _ = kernel(k, st)
        return st, st.position["x"]

    _, xs = jax.jit(lambda s, ks: jax.lax.scan(one, s, ks))(state, jax.random.split(key, 500))

    X = jax.random.normal(jax.random.key(1), (256, 16))
    y = X @ jnp.arange(16.0)
    opt = optax.adam(1e-2)

    def loss(w):
        return jnp.mean((X @ w - y) ** 2)

    @jax.jit
    def fit(w):
        def step(c, _):
            w, s = c
            u, s = opt.update(jax.grad(loss)(w), s, w)
            return (optax.apply_updates(w, u), s), loss(w)
        return jax.lax.scan(step, (w, opt.init(w)), None, length=2000)

    (_, _), losses = fit(jnp.zeros(16))
    return float(xs.mean()), float(losses[-1])


def child(options):
    """One arm, in this process: prints {"wall": s, "events": n, "out": [...]}."""
    import jax
    t0 = time.perf_counter()
    if options is None:
        out, n = program(), 0
    else:
        import jaxtap as tap
        with tap.record(**eval(f"dict({options})")) as rec:  # noqa: S307 - our own arm table
            out = program()
        n = len(rec.events)
    jax.effects_barrier()
    print(json.dumps({"wall": time.perf_counter() - t0, "events": n, "out": out}))


def run_arm(options, env):
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import real_program as r; r.child({options!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", action="store_true", help="also measure the persistent compilation cache")
    a = ap.parse_args(argv)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    rows, plain = [], None
    for name, options in ARMS.items():
        r = run_arm(options, env)
        plain = r["wall"] if options is None else plain
        rows.append((name, r["wall"], r["events"], r["out"]))
    if a.cache:
        with tempfile.TemporaryDirectory() as d:
            cenv = dict(env, JAX_COMPILATION_CACHE_DIR=d, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            for name, options in (("plain, persistent cache warm", None),
                                  ("record(select=lambda _: ()), persistent cache warm", "select=lambda _: ()")):
                run_arm(options, cenv)  # fills the cache
                r = run_arm(options, cenv)
                rows.append((name, r["wall"], r["events"], r["out"]))
    print(f"{'arm':<52} {'wall s':>7} {'x plain':>8} {'events':>7}")
    for name, wall, events, out in rows:
        print(f"{name:<52} {wall:7.2f} {wall / plain:8.2f} {events:7d}   out={out}")
    outs = {tuple(o) for _, _, _, o in rows}
    print("identical outputs across arms:", len(outs) == 1)


if __name__ == "__main__":
    main()
