"""The examples in jax-tap's docstrings run, and show what the code does."""
import doctest
import importlib
import pkgutil

import pytest

import jaxtap

MODULES = sorted(m.name for m in pkgutil.walk_packages(jaxtap.__path__, "jaxtap.") if m.name != "jaxtap.__main__")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"


def test_the_skipped_stderr_examples_print_what_they_show(capfd):
    # tap.print / tap.watch_nan examples print to stderr, which doctest cannot
    # see: run them here and compare
    import jax
    import jax.numpy as jnp
    import jaxtap as tap

    def f(x0, xs):
        return jax.lax.scan(lambda c, x: (c * x, None), x0, xs)

    with tap.record(taps=[tap.print("mul")]):
        f(jnp.float32(1.0), jnp.array([0.5, 0.5]))
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("[tap]")]
    assert err == ["[tap] scan[0]/mul[0] 0/2: array([0.5], dtype=float32)",
                   "[tap] scan[0]/mul[0] 1/2: array([0.25], dtype=float32)"]
    assert all(line in tap.print.__doc__ for line in err)

    def g(c0, xs):
        return jax.lax.scan(lambda c, x: (c + jnp.log(x), None), c0, xs)

    with tap.record(taps=[tap.watch_nan("log", once=True)]):
        g(jnp.float32(0.0), jnp.array([1.0, 0.0, 2.0]))
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("[tap]")]
    assert err == ["[tap] FAIL scan[0]/log[0] 1/3: NaN/Inf"] and err[0] in tap.watch_nan.__doc__
