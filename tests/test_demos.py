"""Every demo in demo/ runs on its own and ends with PASS (exit code 0)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
DEMOS = sorted(DEMO_DIR.glob("[0-9]*.py"))


def _needs(demo):
    """Optional packages a demo imports (blackjax/tqdm: the flagship; pandas: rec.df())."""
    text = demo.read_text()
    needs = ["blackjax", "tqdm"] if "import blackjax" in text else []
    return needs + (["pandas"] if ".df()" in text else [])


@pytest.mark.parametrize("demo", DEMOS, ids=[d.stem for d in DEMOS])
def test_demo_passes(demo):
    for module in _needs(demo):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{demo.name} needs {module}")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_ENABLE_X64", None)
    proc = subprocess.run([sys.executable, str(demo)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=DEMO_DIR.parent)
    lines = proc.stdout.strip().splitlines()
    detail = f"\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{demo.name} exited {proc.returncode}{detail}"
    assert lines and lines[-1] == "PASS", f"{demo.name} did not end with PASS{detail}"


def test_there_are_eleven_demos():
    assert len(DEMOS) == 11, [d.name for d in DEMOS]
