"""Y-taps: per-step scan outputs (``select_ys``, ``on_ys``, ``alert_ys``)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap
from taputil import assert_bits, sync


def scan_with_ys(x0, xs):
    def body(c, x):
        c2 = c * 0.5 + x
        return c2, (c2 * 2.0, x > 0.5)
    return jax.lax.scan(body, x0, xs)


XS = jnp.array([0.1, 0.9, 0.2, 0.7], jnp.float32)


def test_output_events_carry_the_step_outputs():
    _, (ys, flags) = scan_with_ys(jnp.float32(1.0), XS)
    out_events, carry_events = [], []
    g = tap.verbose(scan_with_ys, on_step=carry_events.append, on_ys=out_events.append)
    sync(g(jnp.float32(1.0), XS))
    assert [e.kind for e in out_events] == ["output"] * 4
    assert [e.kind for e in carry_events] == ["carry"] * 4
    for e in out_events:
        assert e.path == "scan[0]" and e.total == 4
        np.testing.assert_array_equal(e.value[0], np.asarray(ys)[e.step])
        assert bool(e.value[1]) == bool(flags[e.step])


def test_select_ys_and_alert_ys_once_in_the_with_form(capfd):
    with tap.record(select_ys=lambda ys: ys[1], alert_ys=lambda e: "flag" if e.value else None,
                    alert_ys_once=True) as rec:
        sync(scan_with_ys(jnp.float32(1.0), XS))
    outputs = [e for e in rec.events if e.kind == "output"]
    assert [bool(e.value) for e in outputs] == [False, True, False, True]
    assert len([e for e in rec.events if e.kind == "carry"]) == 4
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("[tap]")]
    assert lines == ["[tap] FAIL scan[0] 1/4: flag"]


def test_reverse_scan_outputs_match_their_step():
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + x, c * 10.0 + x), jnp.float32(0.0), xs, reverse=True)

    xs = jnp.array([1.0, 2.0, 3.0], jnp.float32)
    _, ys = f(xs)
    seen = []
    sync(tap.verbose(f, on_ys=seen.append, select_ys=lambda ys: ys[0])(xs))
    # execution order: step 0 reads xs[2] and writes ys[2]
    assert [(e.step, float(e.value)) for e in seen] == [(0, float(ys[2])), (1, float(ys[1])), (2, float(ys[0]))]


def test_body_returning_none_has_no_output_events():
    def f(x):
        return jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3)

    seen = []
    sync(tap.verbose(f, on_ys=seen.append, on_step=lambda e: None)(jnp.float32(0.0)))
    assert seen == []


def test_carry_and_ys_cross_in_one_callback_per_step(monkeypatch):
    from jaxtap import _emit

    hops = []
    real = _emit.make_host_fn

    def counting(*args, **kwargs):
        host = real(*args, **kwargs)

        def counted(*a):
            hops.append(1)
            return host(*a)

        return counted

    monkeypatch.setattr(_emit, "make_host_fn", counting)
    events = []
    sync(tap.verbose(scan_with_ys, on_step=events.append, on_ys=events.append)(jnp.float32(1.0), XS))
    assert len(events) == 8
    assert len(hops) == 4


def test_sample_every_and_identity_with_ytaps():
    xs = jnp.linspace(0.0, 1.0, 23, dtype=jnp.float32)
    expected = scan_with_ys(jnp.float32(1.0), xs)
    seen = []
    out = sync(jax.jit(tap.verbose(scan_with_ys, on_ys=seen.append, sample_every=5))(jnp.float32(1.0), xs))
    assert_bits(out, expected)
    assert [e.step for e in seen] == [0, 5, 10, 15, 20]
    grads = jax.grad(lambda x: scan_with_ys(x, xs)[1][0].sum())(jnp.float32(1.0))
    tapped = jax.grad(lambda x: tap.verbose(scan_with_ys, on_ys=lambda e: None)(x, xs)[1][0].sum())(jnp.float32(1.0))
    assert_bits(tapped, grads)


def test_ytaps_outside_ops_warn():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tap.verbose(scan_with_ys, on_ys=print, ops=("while_loop",))
    assert any("y-taps" in str(w.message) for w in caught)


def test_blackjax_mclmc_divergence_recipe(capfd):
    blackjax = pytest.importorskip("blackjax")

    def logdensity(x):
        return -0.5 * jnp.sum(x**2 / jnp.array([1.0, 4.0]))

    key = jax.random.PRNGKey(0)
    state = blackjax.mcmc.mclmc.init(position=jnp.ones(2), logdensity_fn=logdensity, rng_key=key)
    kernel = blackjax.mcmc.mclmc.build_kernel()

    def run():
        return blackjax.mclmc_find_L_and_step_size(mclmc_kernel=kernel, num_steps=40, state=state, rng_key=key,
                                                   logdensity_fn=logdensity)

    expected = run()
    # (BlackJAX's recipe tests `e.value`; its ESS diagnostics' scans also have ys,
    # whose first leaf is an array: any() keeps the alert total there)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tap.record(select_ys=lambda ys: ys[0], alert_ys=lambda e: "divergence" if np.any(e.value) else None,
                        alert_ys_once=True) as rec:
            observed = run()
    assert_bits(observed[:2], expected[:2])
    assert not [w for w in caught if issubclass(w.category, tap.TapWarning)]
    outputs = [e for e in rec.events if e.kind == "output"]
    assert all(e.path.startswith("scan[") for e in outputs)
    # the tuning scan (40 steps x (0.1 + 0.1)): one divergence flag per step
    flags = [e for e in outputs if e.path == "scan[0]"]
    assert [e.step for e in flags] == list(range(8))
    assert all(np.shape(e.value) == () and np.asarray(e.value).dtype == np.bool_ for e in flags)


def test_ytaps_without_scan_in_ops_say_select_ys_has_no_effect():
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tap.verbose(lambda x: x, on_ys=print, select_ys=lambda ys: ys, ops=("while_loop",))
    msgs = [str(x.message) for x in w]
    assert any("select_ys has no effect" in m and "Add 'scan' to ops" in m for m in msgs), msgs
