"""Which JAX this is, which JAX jax-tap is tested on, and JAX internals
imported so that a JAX that moved one never breaks ``import jaxtap``.

A missing internal is recorded in :data:`MISSING` and the name it would have
bound is None: what needs it fails when used, and the with-form turns that
into "ran untapped" with one warning (``_record._intercept``).
"""
from __future__ import annotations

import importlib
import re

import jax

from .._host import warn_once_now

# The releases the test suite proves (README, "Supported JAX"); pyproject.toml
# declares exactly this range.
TESTED_LOW = (0, 10, 2)  # the oldest release tested
TESTED_HIGH = (0, 12)  # the newest minor series tested (every 0.12.x)
TESTED_RANGE = "0.10.2 to 0.12.x"

MISSING: list = []  # "module.attr" of each internal this JAX lacks


def parse(version: str) -> tuple:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a pre-release suffix is dropped."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0].split("rc")[0].split("dev")[0])[:4])


JAX_VERSION_TEXT = jax.__version__
JAX_VERSION = parse(JAX_VERSION_TEXT)


# How a hop packs a value of many leaves into its one uint8 operand
# (``_emit._pack``), measured on NUTS sampling with every depth tapped (the
# trajectory state: 34 leaves), warm. JAX 0.12's XLA:CPU runs leaves joined
# by dtype and bitcast once fastest (55 ms a run against 125 ms); JAX 0.10's
# expands that bitcast into shifts and runs a bitcast kernel per leaf
# faster (72 ms against 135 ms), as does JAX 0.11.2's (85-95 ms against
# 117-153 ms).
JOIN_BY_DTYPE = JAX_VERSION[:2] >= (0, 12)


def tested(version: tuple = JAX_VERSION) -> bool:
    return TESTED_LOW <= version and version[:2] <= TESTED_HIGH


def internal(module: str, attr: str | None = None):
    """``import module`` (and ``getattr(module, attr)``), or None, recorded
    in :data:`MISSING`, where this JAX has no such thing."""
    try:
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    except Exception:  # noqa: BLE001 - any JAX may move its internals
        MISSING.append(module if attr is None else f"{module}.{attr}")
        return None


def check_at_import() -> None:
    """One clear warning when this JAX is outside the tested range (or lacks
    an internal jax-tap uses); the program itself runs as it would."""
    if tested() and not MISSING:
        return
    what = f"JAX {jax.__version__} is outside jax-tap's tested range ({TESTED_RANGE})"
    if tested():
        what = f"JAX {jax.__version__} lacks JAX internals jax-tap uses"
    missing = f" (missing: {', '.join(MISSING[:4])})" if MISSING else ""
    warn_once_now(f"jax-tap: {what}{missing}. Taps may not work: a loop jax-tap cannot tap runs untapped, "
                  f"with a warning. Install a tested JAX, e.g. pip install 'jax>=0.10.2,<0.13'.")
