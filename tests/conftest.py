"""Fixtures for jax-tap's own tests; helpers live in taputil.py."""
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

import jaxtap as tap  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_tap_state():
    yield
    from jaxtap import _record
    if _record.active_contexts():
        tap.emergency_restore()
        pytest.fail("a test left a tap.record() block active")


@pytest.fixture(params=["verbose", "with"])
def form(request):
    """Both forms, for tests of what must hold for both (taputil.Form)."""
    from taputil import Form

    return Form(request.param)
