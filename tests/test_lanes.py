"""Under vmap, each lane's events are the events of that lane run alone.

A vmapped `cond` on a batched predicate runs every branch for every lane,
and a vmapped `while_loop` runs its body for finished lanes too: taps there
must stay silent for the lanes that did not really run them, buffered or
not, directly in the body or nested (jit, checkpoint, inner loops).
"""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from taputil import assert_bits, sync

import jaxtap as tap

pytestmark = pytest.mark.filterwarnings("ignore:.*matched nothing")

X = jnp.array([0.3, 1.0, 2.0, 0.06], jnp.float32)


def cond_in_while(x0):
    def body(s):
        i, c = s
        c = jax.lax.cond(c > 0.5, lambda c: jnp.sin(c) * 0.7, lambda c: jnp.cos(c) * 0.1 * c, c)
        return i + 1, c
    return jax.lax.while_loop(lambda s: s[1] > 0.05, body, (0, x0))


def cond_in_scan(x0):
    def body(c, x):
        c = jax.lax.cond(c > 0.5, lambda c: jnp.sin(c) * 0.7, lambda c: jnp.cos(c) + 0.2 * x, c)
        return c, None
    return jax.lax.scan(body, x0, jnp.arange(4.0, dtype=jnp.float32))


@jax.jit
def _helper(c):
    return jnp.sin(c) * 0.5


def nested_in_while(x0):
    def body(s):
        i, c = s
        c = _helper(c) + 0.01 * jax.checkpoint(jnp.cos)(c)
        d, _ = jax.lax.scan(lambda d, _: (d * 0.9 + 0.01 * jnp.sin(d), None), c, None, length=2)
        return i + 1, d
    return jax.lax.while_loop(lambda s: s[1] > 0.05, body, (0, x0))


def _streams(events, lane=None):
    out = collections.defaultdict(list)
    for e in events:
        out[(e.path, e.kind, e.lane if lane is None else lane)].append(e.step)
    return out


def _lane_by_lane(f, **cfg):
    truth = collections.defaultdict(list)
    for lane in range(len(X)):
        with tap.record(**cfg) as rec:
            sync(f(X[lane]))
        for key, steps in _streams(rec.events, lane).items():
            truth[key] += steps
    return truth


@pytest.mark.parametrize("f", [cond_in_while, cond_in_scan, nested_in_while], ids=lambda f: f.__name__)
@pytest.mark.parametrize("flush_every", [None, 1, 4])
def test_each_lane_sees_what_it_ran(f, flush_every):
    cfg = dict(taps=[tap.on("sin"), tap.on("cos")], select=lambda leaves: leaves[-1])
    truth = _lane_by_lane(f, **cfg)
    with tap.record(flush_every=flush_every, **cfg) as rec:
        out = sync(jax.vmap(f)(X))
    assert_bits(out, jax.vmap(f)(X))
    assert dict(_streams(rec.events)) == dict(truth)


def test_wrapping_a_vmapped_while_with_a_primitive_tap():
    # the wrapper runs vmap(f) as written: the loop and its primitive are
    # tapped where f binds them, lane by lane, as in a with-block
    seen = []
    cfg = dict(taps=[tap.on("sin")], select=lambda leaves: leaves[-1])
    g = tap.verbose(jax.vmap(cond_in_while), on_step=seen.append, **cfg)
    out = sync(g(X))
    assert_bits(out, jax.vmap(cond_in_while)(X))
    with tap.record(**cfg) as rec:
        sync(jax.vmap(cond_in_while)(X))
    assert any(e.kind == "primitive" for e in seen)
    assert dict(_streams(seen)) == dict(_streams(rec.events)) == dict(_lane_by_lane(cond_in_while, **cfg))

def test_a_hop_in_differentiable_code_stays_one_callback_under_vmap():
    """A one-step scan is kept as it is and observed after it, in code JAX
    may differentiate: under vmap its hop is still ONE callback carrying
    every lane (not one per lane: numpyro vmaps such a scan over 50,000
    particles), and each lane gets its event."""
    def f(x):
        return jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, c), x, None, length=1)[0]

    seen = []
    g = tap.verbose(f, on_step=seen.append)
    x = jnp.linspace(0.0, 1.0, 300)
    assert str(jax.make_jaxpr(jax.vmap(g))(x)).count("jaxtap_callback") == 1
    out = jax.vmap(g)(x)
    jax.effects_barrier()
    assert_bits(out, jax.vmap(f)(x))
    assert sorted(e.lane for e in seen) == list(range(300))
    assert np.array_equal(np.array([float(e.value[0]) for e in sorted(seen, key=lambda e: e.lane)]),
                          np.asarray(out))
    grads = jax.vmap(jax.grad(g))(x)
    assert_bits(grads, jax.vmap(jax.grad(f))(x))


def test_a_hop_of_many_lanes_is_one_operand_and_every_lane_arrives():
    """A hop's operand is split in columns of at most ``_CHUNK`` bytes (large
    callback operands are copied asynchronously); past ``_CHUNK`` lanes even
    one byte column is larger, so the hop stays one operand rather than one
    per byte (numpyro's test_subsample_fn: 1M lanes, 84 bytes each)."""
    from jaxtap import _emit
    per = [int(np.prod(c.shape)) for c in _emit._chunks(jnp.zeros((1000, 300), jnp.uint8))]
    assert len(per) > 1 and max(per) <= _emit._CHUNK and sum(per) == 300_000
    assert len(_emit._chunks(jnp.zeros((_emit._CHUNK + 1, 84), jnp.uint8))) == 1
    n = 120_000
    f = jax.jit(jax.vmap(lambda x: jax.lax.scan(lambda c, _: (c * 3 + 1, None), x, None, length=2)[0]))
    x = jnp.arange(n, dtype=jnp.int32)
    with tap.record() as rec:
        out = sync(f(x))
    assert np.array_equal(out, f(x))
    events = rec.events
    assert len(events) == 2 * n
    assert [(e.step, e.lane, int(e.value[0])) for e in events[n - 1:n + 1]] == [(0, n - 1, 3 * (n - 1) + 1), (1, 0, 4)]


_NO_LANES_SCRIPT = r"""
import warnings
import jax, jax.numpy as jnp, numpy as np
from jax import lax
import jaxtap as tap

warnings.simplefilter("error")
w = lambda x: lax.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, x)
s = lambda x: lax.scan(lambda c, _: (jnp.sin(c) + 1.0, c), x, None, length=3)
forms = {"eager": lambda f: jax.vmap(f), "jit(vmap)": lambda f: jax.jit(jax.vmap(f)),
         "vmap(jit)": lambda f: jax.vmap(jax.jit(f)), "vmap(vmap)": lambda f: jax.vmap(jax.vmap(f)),
         "vmap(jacfwd)": lambda f: jax.vmap(jax.jacfwd(lambda x: jax.tree_util.tree_leaves(f(x))[0])),
         "jit(vmap(jvp))": lambda f: jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (x,))))}
for fname, f in {"while": w, "scan": s}.items():
    for form, make in forms.items():
        x = jnp.zeros((0, 2) if form == "vmap(vmap)" else (0,))
        ref = make(f)(x)
        for opts in ({}, {"flush_every": 4}) + (({"taps": [tap.on("sin")]},) if fname == "scan" else ()):
            with tap.record(**opts) as rec:
                got = jax.block_until_ready(make(f)(x))
            assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: a.shape == b.shape, ref, got))
            assert len(rec) == 0, (fname, form, opts, len(rec))
print("NO-LANES-OK")
"""


def test_a_vmap_over_no_lanes_runs_untapped_and_quietly():
    # (eager vmap of a tapped while loop over zero lanes crashed XLA:CPU's
    # compiler; run in a child so that a crash fails this test alone)
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _NO_LANES_SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "NO-LANES-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
