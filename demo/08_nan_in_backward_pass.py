"""08 - A NaN born only in the backward pass.

The story: a smoother c_t = w * c_{t-1} + x_t runs over a signal in a
`lax.scan`; the loss fits c to a target and adds a penalty on the magnitude
of (state, input), `jnp.sqrt(c**2 + x**2)`. With w = 0.5 the input drives
the state back to rest at step 2 and pauses at step 3: c = x = 0 there. The forward pass is perfectly finite (sqrt(0) is
0), so the loss prints fine - but the derivative of sqrt at 0 is 1/0, times
a zero: the gradient is NaN, and after one optimizer step every parameter
is NaN. The user sees "loss: 3.2, then nan" and starts bisecting data.

jax-tap: a forward NaN watch on the loss is silent - nothing is born there
(`tap.watch_nan()` with no primitive name reports NaN/Inf *birth sites*,
equations whose inputs are finite and whose output is not). With cotangent
taps, `tap.record(jax.grad(loss), backward=True,
taps=[tap.watch_nan("mul")])` watches the backward loop JAX builds for the
scan *at the forward loop's address*: the live line

    [tap] FAIL scan[0]/mul[5] (backward) 3/12: NaN/Inf in mul at 08_nan_in_backward_pass.py:43

names the forward loop, the forward step, the primitive and the line whose
derivative produced it (the 1/(2 sqrt(0)) of sqrt's derivative, times the
cotangent). Cotangent events (`kind="cotangent"`) show the carry's
cotangent turning NaN at that step. A forward carry tap cross-checks the
step (it is where c and x are both 0). The tapped gradient is bitwise the
untapped one; the fix (sqrt(u + eps)) trains.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtap as tap

XS = jnp.array([0.8, 0.6, -0.5, 0.0, 0.7, 1.2, 0.3, -0.4, 0.6, 0.9, 0.5, 1.0], jnp.float32)
TARGET = jnp.linspace(0.0, 1.0, XS.shape[0], dtype=jnp.float32)


def loss(w, xs):
    """The user's loss. No logging lines."""

    def body(c, x):
        c = w * c + x
        return c, (c - TARGET.mean()) ** 2 + 0.1 * jnp.sqrt(c**2 + x**2)

    return jax.lax.scan(body, jnp.float32(0.0), xs)[1].sum()


def loss_fixed(w, xs):
    def body(c, x):
        c = w * c + x
        return c, (c - TARGET.mean()) ** 2 + 0.1 * jnp.sqrt(c**2 + x**2 + 1e-12)

    return jax.lax.scan(body, jnp.float32(0.0), xs)[1].sum()


def train(fn, w, steps=3, lr=0.05):
    value_and_grad = jax.jit(jax.value_and_grad(fn))
    history = []
    for _ in range(steps):
        value, g = value_and_grad(w, XS)
        history.append(float(value))
        w = w - lr * g
    return history, w


def main():
    sys.stdout.reconfigure(line_buffering=True)
    w0 = jnp.float32(0.5)
    history, w = train(loss, w0)
    print(f"training: loss {' -> '.join(f'{v:.3f}' for v in history)}; w = {float(w)}  <- NaN from nowhere")

    with tap.record(taps=[tap.watch_nan()]) as fwd:          # forward pass, watched for births
        value = loss(w0, XS)
    fwd_births = [e for e in fwd.events if e.kind == "primitive"]
    print(f"forward pass watched: loss {float(value):.3f}, NaN/Inf births: {len(fwd_births)} (silent)")

    print("tapping jax.grad(loss) with backward=True and tap.watch_nan('mul'):")
    grad_watched, rec = tap.record(jax.grad(loss), backward=True, select=lambda ct: ct[0],
                                   taps=[tap.watch_nan("mul", once=True)])
    g_tapped = jax.block_until_ready(grad_watched(w0, XS))
    jax.effects_barrier()
    fails = [e for e in rec.events if e.kind == "primitive" and e.backward]
    first = max(fails, key=lambda e: e.step)  # the backward pass walks the forward steps down
    forward_step = first.step
    cot = {e.step: float(e.value) for e in rec.events if e.kind == "cotangent"}
    print(f"  first non-finite product at forward step {forward_step}/{first.total} ({first.path});"
          f" carry cotangent there: {cot[forward_step]}, one step later: {cot[forward_step + 1]}")
    g_clean = jax.grad(loss)(w0, XS)
    same = np.asarray(g_tapped).tobytes() == np.asarray(g_clean).tobytes()
    print(f"gradient {float(g_clean)}; tapped gradient bitwise identical: {same}")

    # Cross-check the step with a plain forward carry tap: where are c and x both zero?
    with tap.record(select=lambda leaves: leaves[0]) as carry:
        loss(w0, XS)
    c = np.array([e.value for e in carry.events])
    at_rest = [int(t) for t in np.nonzero((c == 0.0) & (np.asarray(XS) == 0.0))[0]]
    print(f"forward carry: c = x = 0 at steps {at_rest}")

    fixed_history, w_fixed = train(loss_fixed, w0)
    print(f"fix sqrt(c**2 + x**2 + 1e-12): loss {' -> '.join(f'{v:.3f}' for v in fixed_history)}, "
          f"w = {float(w_fixed):.4f}")

    ok = (same and np.isnan(history[-1]) and np.isfinite(history[0]) and not fwd_births
          and forward_step == at_rest[0] and first.total == XS.shape[0]
          and np.isfinite(fixed_history).all() and fixed_history[-1] < fixed_history[0])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
