"""Regenerate docs/quickstart_plot.png (the picture in the README)."""
import os

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")

import jaxtap as tap  # noqa: E402


def oscillators(x0, ts):
    def body(c, t):
        pos, vel = c
        vel = vel - 0.05 * pos - 0.02 * vel
        return (pos + vel, vel), None
    return jax.lax.scan(body, x0, ts)


with tap.record(select=lambda leaves: {"position": leaves[0], "velocity": leaves[1]}) as rec:
    oscillators((jnp.float32(1.0), jnp.float32(0.0)), jnp.arange(200.0))
ax = rec.df().set_index("step")[["position", "velocity"]].plot(title="scan[0] carry, streamed live", figsize=(7, 3.2))
ax.set_xlabel("step")
ax.figure.tight_layout()
ax.figure.savefig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "quickstart_plot.png"), dpi=90)
