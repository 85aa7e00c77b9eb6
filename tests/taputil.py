"""Helpers shared by jax-tap's own tests (import as `from taputil import ...`)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def sync(out=None):
    """Wait for results and for every pending host callback."""
    if out is not None:
        jax.block_until_ready(out)
    jax.effects_barrier()
    return out


def is_key(x) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def _leaf_bits(x):
    if is_key(x):
        return ("key", str(x.dtype), x.shape, np.asarray(jax.random.key_data(x)).tobytes())
    a = np.ascontiguousarray(np.asarray(x))
    return (type(x).__name__ if not isinstance(x, jax.Array) else "Array", str(a.dtype), a.shape, a.tobytes())


def assert_bits(ref, got, what="", types=False):
    """The one bitwise check: same tree, and per leaf the same dtype, shape
    and bytes (PRNG keys compared by their key data); ``types``: the same
    Python type too (a JAX array is not a NumPy one)."""
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref)
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    assert ref_tree == got_tree, f"{what}: tree structure differs: {ref_tree} vs {got_tree}"
    for i, (r, g) in enumerate(zip(ref_leaves, got_leaves)):
        rb, gb = _leaf_bits(r), _leaf_bits(g)
        k = 0 if types else 1
        assert rb[k:3] == gb[k:3], f"{what}: leaf {i} type/dtype/shape differ: {rb[:3]} vs {gb[:3]}"
        if rb[3] != gb[3]:
            ra = np.asarray(jax.random.key_data(r) if is_key(r) else r)
            ga = np.asarray(jax.random.key_data(g) if is_key(g) else g)
            bad = np.flatnonzero(np.ascontiguousarray(ra).reshape(-1).view(np.uint8)
                                 != np.ascontiguousarray(ga).reshape(-1).view(np.uint8))
            raise AssertionError(
                f"{what}: leaf {i} ({rb[1]}{list(rb[2])}) differs bitwise in {bad.size} bytes; "
                f"first values ref={ra.reshape(-1)[:4]} tapped={ga.reshape(-1)[:4]}")


def bits_equal(a, b) -> bool:
    try:
        assert_bits(a, b)
        return True
    except AssertionError:
        return False


def run_python(script, *flags, timeout=300):
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("JAX_ENABLE_X64", None)
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def cases(gaps):
    """pytest params named by ``gaps`` (name -> None, or the reason of a known
    gap): a gap is a strict xfail, run and counted. A gap given as
    ``(reason, False)`` is a non-strict xfail: a rounding gap that another
    CPU's code generation may not show."""
    for name, gap in gaps.items():
        reason, strict = gap if isinstance(gap, tuple) else (gap, True)
        marks = [pytest.mark.xfail(strict=strict, reason=reason)] if gap else []
        yield pytest.param(name, marks=marks, id=name)


class Form:
    """One of the two ways to hold the lens (``form`` fixture, conftest.py):
    tests of what must hold for both take it instead of being written twice."""

    def __init__(self, name):
        self.name = name  # "verbose" (the wrapping form) or "with"

    def run(self, fn, *args, **cfg):
        """``fn(*args)`` observed with ``cfg``: (outputs, recorder events)."""
        import jaxtap as tap

        if self.name == "verbose":
            g, rec = tap.record(fn, **cfg)
            out = g(*args)
        else:
            with tap.record(**cfg) as rec:
                out = fn(*args)
        return sync(out), list(rec.events)

    def lowered(self, fn, *args, **cfg) -> str:
        """The compiled program text of ``jax.jit(fn)`` observed with ``cfg``."""
        import jaxtap as tap

        if self.name == "verbose":
            return jax.jit(tap.verbose(fn, **cfg)).lower(*args).as_text()
        with tap.record(**cfg):
            return jax.jit(fn).lower(*args).as_text()

    def __repr__(self):
        return self.name
