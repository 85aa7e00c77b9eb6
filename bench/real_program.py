"""A real program under the lens: BlackJAX NUTS (window adaptation, then
sampling) and an optax Adam training loop, each arm in a fresh process so
that every arm pays its own first-call compilation.

    python bench/real_program.py            # all arms, 1 repeat each
    python bench/real_program.py --cache    # also: JAX's persistent compilation cache, warm, tapped vs not
    python bench/real_program.py --first-call   # a BlackJAX window adaptation alone, 3 repeats (median)
    python bench/real_program.py --repeats 5 --arms defaults   # plain and the defaults, 5 interleaved rounds

Reports wall time per arm and its ratio to the plain program measured in the
same run (the with-block and the run; then, apart, the time to read every
recorded event as a TapEvent, which a recorder builds when read). Needs the [test] extras (blackjax, optax).
"""
import argparse
import json
import os
import statistics
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

# --first-call: what a user of BlackJAX's progress bar pays on a first call
FIRST_CALL_ARMS = {
    "plain": None,
    "blackjax.progress_bar()": "progress_bar",
    "record(select=lambda _: (), ops=('scan',), max_depth=0) (its options)":
        "select=lambda _: (), ops=('scan',), max_depth=0",
    "record(select=lambda _: ()), every depth": "select=lambda _: ()",
    "record() defaults": "",
}


def window_adaptation():
    """A BlackJAX NUTS window adaptation, 100 steps: a scan of NUTS kernels."""
    import blackjax
    import jax
    import jax.numpy as jnp

    def logdensity(p):
        x, s = p["x"], p["log_s"]
        return -0.5 * jnp.sum((x - 1.0) ** 2 / jnp.exp(2 * s)) - jnp.sum(s) - 0.5 * jnp.sum(s ** 2)

    warm = blackjax.window_adaptation(blackjax.nuts, logdensity)
    (state, _), _ = warm.run(jax.random.key(0), {"x": jnp.zeros(5), "log_s": jnp.zeros(5)}, num_steps=100)
    return [float(v) for v in state.position["x"]]


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


def child(options, first_call=False):
    """One arm, in this process: prints {"wall": s, "events": n, "out": [...]}."""
    import jax
    work = window_adaptation if first_call else program
    t0 = time.perf_counter()
    if options is None:
        out, n = work(), 0
    elif options == "progress_bar":
        import blackjax
        # its own file: the bar writes output_file by os.replace and deletes
        # it on exit (never give it os.devnull)
        with tempfile.TemporaryDirectory() as d, blackjax.progress_bar(output_file=os.path.join(d, "bar.txt")):
            out, n = work(), -1
    else:
        import jaxtap as tap
        with tap.record(**eval(f"dict({options})")) as rec:  # noqa: S307 - our own arm table
            out = work()
        n = len(rec)
    jax.effects_barrier()
    wall = time.perf_counter() - t0
    read = 0.0
    if options not in (None, "progress_bar"):
        # reading every event: a recorder builds the TapEvents it kept as
        # bytes or columns now, when they are read (reported apart)
        t1 = time.perf_counter()
        assert len(rec.events) == n
        read = time.perf_counter() - t1
    print(json.dumps({"wall": wall, "events": n, "out": out, "read": read}))


def run_arm(options, env, first_call=False):
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import real_program as r; "
            f"r.child({options!r}, {first_call!r})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", action="store_true", help="also measure the persistent compilation cache")
    ap.add_argument("--first-call", action="store_true", help="a window adaptation alone: first-call cost")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the arms interleaved this many times; report each arm's median (and each round's ratio)")
    ap.add_argument("--arms", default="",
                    help="comma-separated substrings: only the arms whose names hold one (plain always runs)")
    a = ap.parse_args(argv)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if a.first_call:
        first_calls(env)
        return
    wanted = [w.strip() for w in a.arms.split(",") if w.strip()]
    arms = {n: o for n, o in ARMS.items() if o is None or not wanted or any(w in n for w in wanted)}
    runs = {name: [] for name in arms}
    for _ in range(a.repeats):  # interleaved: a slow minute of the machine hits every arm alike
        for name, options in arms.items():
            runs[name].append(run_arm(options, env))
    rows = []
    for name, rs in runs.items():
        mid = sorted(rs, key=lambda r: r["wall"])[len(rs) // 2]
        rows.append((name, mid["wall"], mid["events"], mid["out"], mid["read"], [r["wall"] for r in rs]))
    plain_walls = rows[0][5]
    if a.cache:
        with tempfile.TemporaryDirectory() as d:
            cenv = dict(env, JAX_COMPILATION_CACHE_DIR=d, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            for name, options in (("plain, persistent cache warm", None),
                                  ("record(select=lambda _: ()), persistent cache warm", "select=lambda _: ()")):
                run_arm(options, cenv)  # fills the cache
                r = run_arm(options, cenv)
                rows.append((name, r["wall"], r["events"], r["out"], r["read"], [r["wall"]]))
    plain = rows[0][1]
    print(f"{'arm':<52} {'wall s':>7} {'x plain':>8} {'events':>7} {'read s':>7}")
    for name, wall, events, out, read, walls in rows:
        print(f"{name:<52} {wall:7.2f} {wall / plain:8.2f} {events:7d} {read:7.2f}   out={out}")
        if len(walls) > 1 and len(walls) == len(plain_walls):
            print(f"{'':<52} each round x that round's plain: "
                  + " / ".join(f"{w / p:.2f}" for w, p in zip(walls, plain_walls)))
    outs = {tuple(r[3]) for r in rows}
    print("identical outputs across arms:", len(outs) == 1)


def first_calls(env, repeats=3):
    """Each arm in a fresh process, the arms interleaved ``repeats`` times:
    the median wall time and its ratio to the plain one."""
    walls = {name: [] for name in FIRST_CALL_ARMS}
    outs = set()
    for _ in range(repeats):
        for name, options in FIRST_CALL_ARMS.items():
            r = run_arm(options, env, first_call=True)
            walls[name].append(r["wall"])
            outs.add(tuple(r["out"]))
    plain = statistics.median(walls["plain"])
    print(f"{'arm (window adaptation, 100 steps, first call)':<72} {'wall s':>7} {'x plain':>8}")
    for name, w in walls.items():
        print(f"{name:<72} {statistics.median(w):7.2f} {statistics.median(w) / plain:8.2f}")
    print("identical outputs across arms:", len(outs) == 1)


if __name__ == "__main__":
    main()
