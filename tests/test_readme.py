"""Every ```python block of the README runs, in order, in one namespace."""
import os
import re

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "..", "README.md")


def python_blocks():
    text = open(README, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_blocks():
    assert len(python_blocks()) >= 5


def test_every_readme_python_block_runs(capfd):
    namespace = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        try:
            exec(compile(block, f"README block {i}", "exec"), namespace)
            jax.effects_barrier()
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"README python block {i} failed: {exc!r}\n{block}") from exc
    err = capfd.readouterr().err
    assert "[tap] FAIL scan[0]/jit[0]/cholesky[0] 7/10: NaN/Inf" in err
    assert "[tap] FAIL scan[0] 7/10: carry=6.22 exceeded 5.0" in err
    assert "[tap] FAIL scan[0]/jit[0]/cholesky[0] 6/10: L[1,1] < 1" in err
