"""Helpers shared by jax-tap's own tests (import as `from taputil import ...`)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402


def sync(out=None):
    """Wait for results and for every pending host callback."""
    if out is not None:
        jax.block_until_ready(out)
    jax.effects_barrier()
    return out


def bits_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if np.ascontiguousarray(x).tobytes() != np.ascontiguousarray(y).tobytes():
            return False
    return True


def assert_bits(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structure differs: {ta} vs {tb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"leaf {i}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        assert np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes(), f"leaf {i} bits differ:\n{x!r}\n{y!r}"


def run_python(script, *flags, timeout=300):
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("JAX_ENABLE_X64", None)
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=timeout, env=env)
