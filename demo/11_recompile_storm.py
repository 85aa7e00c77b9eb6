"""11 - "Training is slow": a recompile storm.

The story: a small regression model trains for 12 epochs with a jitted
`train_epoch` (an optax-style Adam loop in `lax.scan`). Each epoch gets a
fresh batch of data, whose size the loader lets vary: the number of rows
left after filtering changes every epoch. The loss goes down and nothing
fails, but every epoch takes as long as the first. A profiler shows time in
"XLA compilation"; which function, and why, it does not say.

jax-tap: the same code, unmodified, under
`tap.record(jit_events=True, max_compiles=2, select=lambda _: ())`. The
third compilation of `train_epoch` prints a live FAIL line naming the
argument that changed (`x: f32[..,8] (was f32[..,8])`), and the compile
events split the run: tracing + lowering + compiling seconds against the
rest. Fix: pad each batch to a fixed size with a mask (a shape that never
changes). Checks: the storm compiles once per epoch and the fix compiles
once; every compile event after the first names `x` and `mask`/`y`; the
compile events account for most of the storm's wall time, and the fix spends
a fraction of the storm's compile time (its one compile then dominates a
run this small); the tapped losses equal the untapped ones bitwise; and a
timeline file of the run validates as Chrome trace-event JSON.
"""
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

EPOCHS, STEPS, FEATURES, PAD = 12, 50, 8, 64


def loader(epoch):
    """Rows left after filtering: a different count every epoch."""
    rng = np.random.default_rng(epoch)
    n = 40 + 2 * epoch
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x @ np.arange(1, FEATURES + 1, dtype=np.float32) + 0.1 * rng.normal(size=n)).astype(np.float32)
    return x, y


@jax.jit
def train_epoch(w, x, y, mask):
    """The user's training loop (Adam in a scan). No logging lines."""

    def loss(w):
        r = (x @ w - y) * mask
        return jnp.sum(r * r) / jnp.sum(mask)

    def step(state, _):
        w, m, v, t = state
        g = jax.grad(loss)(w)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        t = t + 1.0
        w = w - 0.05 * (m / (1 - 0.9 ** t)) / (jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        return (w, m, v, t), loss(w)

    zeros = jnp.zeros_like(w)
    (w, _, _, _), losses = jax.lax.scan(step, (w, zeros, zeros, jnp.float32(0.0)), None, length=STEPS)
    return w, losses[-1]


def storm():
    """The user's script: each epoch's batch as the loader gives it."""
    w, out = jnp.zeros(FEATURES), []
    for epoch in range(EPOCHS):
        x, y = loader(epoch)
        w, last = train_epoch(w, x, y, jnp.ones(len(y)))
        out.append(float(last))
    return np.array(out)


def fixed():
    """The fix: pad every batch to PAD rows with a 0/1 mask."""
    w, out = jnp.zeros(FEATURES), []
    for epoch in range(EPOCHS):
        x, y = loader(epoch)
        n = len(y)
        xp = np.zeros((PAD, FEATURES), np.float32)
        xp[:n] = x
        yp, mask = np.zeros(PAD, np.float32), np.zeros(PAD, np.float32)
        yp[:n], mask[:n] = y, 1.0
        w, last = train_epoch(w, xp, yp, mask)
        out.append(float(last))
    return np.array(out)


def lensed(run):
    """Run `run` under the lens; (losses, compile events, wall seconds, recorder)."""
    with tap.record(jit_events=True, max_compiles=2, select=lambda _: ()) as rec:
        t0 = time.perf_counter()
        losses = run()
        wall = time.perf_counter() - t0
    return losses, [e for e in rec.events if e.kind == "compile"], wall, rec


def main():
    sys.stdout.reconfigure(line_buffering=True)
    print("== the symptom: every epoch is slow, nothing fails")
    losses_plain = storm()
    print(f"final loss {losses_plain[-1]:.4f}; loss went down: {losses_plain[-1] < losses_plain[0]}")

    print("\n== under the lens (code unmodified): jit events, FAIL on a third compile")
    jax.clear_caches()
    losses, compiles, wall, rec = lensed(storm)
    jit_s = sum(e.value["trace_s"] + e.value["lower_s"] + e.value["compile_s"] for e in compiles)
    print(f"{len(compiles)} compilations of {sorted({e.path for e in compiles})}")
    for e in compiles[:3]:
        print(f"  #{e.step}: {e.value['reason']}  ({e.value['compile_s'] * 1e3:.0f} ms XLA)")
    print(f"tracing+lowering+compiling {jit_s:.2f} s of {wall:.2f} s wall ({jit_s / wall:.0%})")
    timeline = os.path.join(tempfile.mkdtemp(), "storm.trace.json")
    rec.timeline(timeline)
    print(f"timeline for Perfetto UI: {timeline}")

    print("\n== the fix: pad to a fixed shape with a mask")
    jax.clear_caches()
    losses_fix, compiles_fix, wall_fix, _ = lensed(fixed)
    jit_fix = sum(e.value["trace_s"] + e.value["lower_s"] + e.value["compile_s"] for e in compiles_fix)
    print(f"{len(compiles_fix)} compilation; {jit_fix:.2f} s of {wall_fix:.2f} s wall; "
          f"final loss {losses_fix[-1]:.4f}")

    with open(timeline, encoding="utf-8") as fh:
        spans = [ev for ev in json.load(fh)["traceEvents"] if ev["ph"] == "X"]
    checks = {
        "the storm compiles once per epoch": len(compiles) == EPOCHS,
        "each recompile names the changed arguments": all(
            e.value["reason"].startswith("x: f32[") and "(was f32[" in e.value["reason"] for e in compiles[1:]),
        "compilation is most of the storm's time": jit_s > 0.5 * wall,
        "the fix compiles once": len(compiles_fix) == 1,
        "the fix compiles in a fraction of the storm's time": jit_fix < 0.25 * jit_s,
        "tapped losses are bitwise the untapped ones": np.array_equal(losses, losses_plain),
        "the timeline holds every compile span": sum(s["args"]["phase"] == "compile" for s in spans) == EPOCHS,
    }
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    ok = all(checks.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
