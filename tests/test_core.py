"""The core transform and the wrapping form: options, addressing, caching,
bad input, totality and the things the walker must leave alone."""
import collections
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtap as tap
from jaxtap import _seam as tap_seam

from taputil import assert_bits, cases, run_python, sync


def scan_while(x0, xs):
    def inner(s):
        return s[0] + 1, s[1] * 1.25 + 1.0

    def body(c, x):
        _, v = jax.lax.while_loop(lambda s: s[0] < 3, inner, (jnp.int32(0), c + x))
        return v * 0.5, v

    return jax.lax.scan(body, x0, xs)


ARGS = (jnp.float32(0.5), jnp.linspace(0.0, 1.0, 4, dtype=jnp.float32))


def events_of(f, *args, **kw):
    seen = []
    out = sync(tap.verbose(f, on_step=seen.append, **kw)(*args))
    return seen, out


# ------------------------------------------------------------------ basics
def test_wrapper_keeps_name_and_docstring():
    def my_function(x):
        """Docs."""
        return x

    g = tap.verbose(my_function, on_step=print)
    assert g.__name__ == "my_function"
    assert g.__doc__ == "Docs."


def test_event_is_frozen_and_step_is_python_int():
    seen, _ = events_of(scan_while, *ARGS)
    e = seen[0]
    assert type(e.step) is int
    with pytest.raises(Exception):
        e.step = 3
    assert {x.kind for x in seen} == {"carry"}
    assert {x.total for x in seen if x.path == "scan[0]"} == {4}
    assert {x.total for x in seen if x.path == "scan[0]/while[0]"} == {None}


def test_event_values_are_host_numpy_copies():
    seen, _ = events_of(scan_while, *ARGS, select=lambda leaves: {"v": leaves[0], "vec": jnp.stack([leaves[0]] * 3)})
    for e in seen:
        assert isinstance(e.value["v"], np.generic)
        assert isinstance(e.value["vec"], np.ndarray) and e.value["vec"].flags.owndata


def test_nothing_to_observe_means_no_callback_at_all():
    text = str(jax.make_jaxpr(tap.verbose(scan_while))(*ARGS))
    assert "callback" not in text
    assert "callback" in str(jax.make_jaxpr(tap.verbose(scan_while, on_step=print))(*ARGS))


def test_keyword_and_static_python_arguments_work_as_for_f():
    def f(x, n, *, mode="add", fn=jnp.sin, extra=None, scale=2.0):
        def body(c, _):
            c = c + fn(c) if mode == "add" else c * fn(c)
            return c * scale if extra is None else c, None
        return jax.lax.scan(body, x, None, length=n)[0]

    seen = []
    g = tap.verbose(f, on_step=seen.append)
    for kwargs in ({}, {"mode": "mul", "fn": jnp.cos}, {"extra": "x", "scale": 0.5}):
        assert_bits(g(jnp.float32(0.3), 3, **kwargs), f(jnp.float32(0.3), 3, **kwargs))
        assert_bits(g(jnp.float32(0.3), n=5, **kwargs), f(jnp.float32(0.3), n=5, **kwargs))
    sync()
    assert len(seen) == 3 * (3 + 5)


def test_verbose_runs_f_as_written_and_jit_traces_once_per_signature():
    """The wrapper calls ``f`` itself each time (eager Python runs as it
    would untapped); under ``jax.jit`` it is traced once per signature, and
    a pre-jitted ``f`` compiles its tapped twin once."""
    runs = []

    def f(x0, xs):
        runs.append(1)
        return scan_while(x0, xs)

    seen = []
    g = tap.verbose(f, on_step=seen.append)
    for _ in range(3):
        sync(g(*ARGS))
    assert len(runs) == 3 and len(seen) > 0
    runs.clear()
    h = jax.jit(g)
    for _ in range(3):
        sync(h(*ARGS))
    assert len(runs) == 1
    sync(h(jnp.zeros(2), jnp.ones((4, 2))))
    assert len(runs) == 2
    runs.clear()
    fj = jax.jit(f)
    sync(fj(*ARGS))  # compiled clean first
    gj = tap.verbose(fj, on_step=seen.append)
    n = len(seen)
    for _ in range(3):
        sync(gj(*ARGS))
    assert len(runs) == 2  # one clean trace, one tapped trace
    assert len(seen) > n
    n = len(seen)
    sync(fj(*ARGS))  # the clean compilation again: no events, no trace
    assert len(runs) == 2 and len(seen) == n


def test_a_wrappers_addresses_do_not_depend_on_where_it_is_called():
    seen = []
    g = tap.verbose(jax.jit(scan_while), on_step=seen.append)
    sync(g(*ARGS))
    first = collections.Counter(e.path for e in seen)
    seen.clear()
    sync(g(jnp.zeros(2), jnp.ones((4, 2))))  # a retrace, from another line
    eager = tap.verbose(scan_while, on_step=seen.append)
    sync(eager(*ARGS))
    sync(eager(*ARGS))
    assert first == {"scan[0]": 4, "scan[0]/while[0]": 12}
    assert collections.Counter(e.path for e in seen) == {"scan[0]": 12, "scan[0]/while[0]": 36}


def test_verbose_method_binding():
    class Model:
        def __init__(self):
            self.scale = 3.0

        @functools.partial(tap.verbose, on_step=lambda e: None)
        def run(self, x):
            return jax.lax.scan(lambda c, _: (c * self.scale, None), x, None, length=2)[0]

    assert float(Model().run(jnp.float32(1.0))) == 9.0


# -------------------------------------------------------------- volume knobs
def test_ops_choose_loop_kinds_but_the_walk_descends_into_all():
    only_while, _ = events_of(scan_while, *ARGS, ops=("while_loop",))
    assert {e.path for e in only_while} == {"scan[0]/while[0]"}
    only_scan, _ = events_of(scan_while, *ARGS, ops=("scan",))
    assert {e.path for e in only_scan} == {"scan[0]"}
    fori = lambda x: jax.lax.fori_loop(0, 5, lambda i, c: c + i, x)  # noqa: E731
    seen, _ = events_of(fori, jnp.float32(0.0))
    assert [e.step for e in seen] == [0, 1, 2, 3, 4]
    mapped = lambda xs: jax.lax.map(jnp.sin, xs)  # noqa: E731
    seen, _ = events_of(mapped, jnp.ones(3))
    assert [e.path for e in seen] == ["scan[0]"] * 3


def test_max_depth_zero_keeps_only_outermost_loops():
    seen, _ = events_of(scan_while, *ARGS, max_depth=0)
    assert {e.path for e in seen} == {"scan[0]"}


def test_unsampled_steps_do_not_run_select():
    calls = []

    def select(leaves):
        jax.debug.callback(lambda: calls.append(1))
        return leaves[0]

    def f(x):
        return jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=30)

    seen, _ = events_of(f, jnp.float32(0.0), select=select, sample_every=10)
    assert [e.step for e in seen] == [0, 10, 20]
    assert len(calls) == 3


def test_sample_every_on_a_while_loop_with_a_short_final_chunk():
    def f(x):
        return jax.lax.while_loop(lambda s: s[0] < 23, lambda s: (s[0] + 1, s[1] * 1.01), (0, x))

    seen, out = events_of(f, jnp.float32(1.0), sample_every=5, select=lambda leaves: leaves[0])
    assert [e.step for e in seen] == [0, 5, 10, 15, 20]
    assert [int(e.value) for e in seen] == [1, 6, 11, 16, 21]
    assert_bits(out, f(jnp.float32(1.0)))


def test_reverse_scan_steps_count_execution_order():
    def f(xs):
        return jax.lax.scan(lambda c, x: (c * 10 + x, c), jnp.int32(0), xs, reverse=True)

    seen, out = events_of(f, jnp.arange(1, 4, dtype=jnp.int32), select=lambda leaves: leaves[0])
    assert [(e.step, int(e.value)) for e in seen] == [(0, 3), (1, 32), (2, 321)]
    assert_bits(out, f(jnp.arange(1, 4, dtype=jnp.int32)))


# ------------------------------------------------------------------ addresses
def test_addresses_ignore_what_precedes_the_loop_and_an_outer_jit():
    helper = jax.jit(lambda x: jnp.cos(x) * 2.0)

    def f(x0, xs):
        y = helper(x0) + jnp.sum(xs)
        z = jax.lax.scan(lambda c, x: (c + x, None), y, xs)[0]
        return scan_while(z, xs)

    plain, _ = events_of(f, *ARGS)
    jitted, _ = events_of(jax.jit(f), *ARGS)
    under = []
    sync(jax.jit(tap.verbose(f, on_step=under.append))(*ARGS))
    with tap.record() as rec:
        sync(jax.jit(f)(*ARGS))
    paths = lambda es: sorted({e.path for e in es})  # noqa: E731
    assert paths(plain) == ["scan[0]", "scan[1]", "scan[1]/while[0]"]
    assert paths(plain) == paths(jitted) == paths(under) == paths(rec.events)


def test_loops_in_cond_branches_checkpoint_and_jit_are_found():
    @jax.checkpoint
    def ck(c):
        return jax.lax.fori_loop(0, 2, lambda i, v: v * 1.5, c)

    inner_jit = jax.jit(lambda c: jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] + 1.0), (0, c))[1])

    def f(x0, xs):
        def body(c, x):
            c = jax.lax.cond(x > 0.5, lambda u: jax.lax.fori_loop(0, 3, lambda i, v: v + i, u), lambda u: u, c)
            return inner_jit(ck(c)), None
        return jax.lax.scan(body, x0, xs)

    seen, out = events_of(f, *ARGS)
    assert_bits(out, f(*ARGS))
    paths = {e.path for e in seen}
    assert "scan[0]/jit[0]/while[0]" in paths
    assert {"scan[0]", "scan[0]/scan[0]", "scan[0]/scan[1]"} <= paths


def test_path_aware_select_signatures():
    def two_with_default(leaves, other=5):
        return leaves[0] * other

    def two_other_name(leaves, where_am_i):
        return {"p": where_am_i}

    seen, _ = events_of(scan_while, *ARGS, select=two_with_default, max_depth=0)
    assert len(seen) == 4 and np.shape(seen[0].value) == ()
    seen, _ = events_of(scan_while, *ARGS, select=two_other_name, max_depth=0)
    assert {e.value["p"] for e in seen} == {"scan[0]"}
    seen, _ = events_of(scan_while, *ARGS, select=lambda leaves, path=None: {"p": path})
    assert {e.value["p"] for e in seen} == {"scan[0]", "scan[0]/while[0]"}


# --------------------------------------------------------------- inner jits
def test_inner_jit_parameters_are_preserved():
    inner = jax.jit(lambda c, d: (c * 2.0 + d, d), donate_argnums=(1,), keep_unused=True, inline=False)

    def f(x0, xs):
        return jax.lax.scan(lambda c, x: (inner(c, x)[0], None), x0, xs)[0]

    jaxpr = jax.make_jaxpr(tap.verbose(f, on_step=print))(*ARGS)

    def find(j):
        for e in j.eqns:
            if e.primitive.name == "jit" and e.params["name"] == "<lambda>":
                return e
            for v in e.params.values():
                sub = getattr(v, "jaxpr", None)
                if sub is not None and hasattr(sub, "eqns"):
                    hit = find(sub)
                    if hit is not None:
                        return hit
        return None

    eqn, plain = find(jaxpr.jaxpr), find(jax.make_jaxpr(f)(*ARGS).jaxpr)
    assert eqn is not None and plain is not None
    assert eqn.params["keep_unused"] is True
    assert eqn.params["donated_invars"][:2] == (False, True)
    # (JAX >= 0.11 spells inline=False as an enum: compare with the untapped equation)
    for key in ("inline", "keep_unused", "name", "ctx_mesh", "compiler_options_kvs"):
        assert eqn.params.get(key) == plain.params.get(key), key


def test_shard_map_inside_a_loop_is_tapped():
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def f(x):
        g = jax.shard_map(lambda v: jax.lax.scan(lambda c, _: (c * 1.5, None), v, None, length=3)[0],
                          mesh=mesh, in_specs=P(), out_specs=P())
        return jax.lax.scan(lambda c, _: (g(c) + 1.0, None), x, None, length=2)[0]

    seen, out = events_of(f, jnp.float32(1.0))
    assert_bits(out, f(jnp.float32(1.0)))
    assert {e.path for e in seen} == {"scan[0]", "scan[0]/scan[0]"}
    inner = [e for e in seen if e.path == "scan[0]/scan[0]"]
    assert [e.step for e in inner] == [0, 1, 2] * 2
    assert {(e.shard, e.device) for e in inner} == {(0, jax.devices()[0].id)}


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"sample_every": 0}, ValueError, "sample_every"),
        ({"sample_every": 2.5}, ValueError, "positive int"),
        ({"sample_every": True}, ValueError, "sample_every"),
        ({"sample_every": 2**31}, ValueError, "at most 2147483647"),
        ({"flush_every": np.float32(4)}, ValueError, "flush_every"),
        ({"ops": ("scan", "whle_loop")}, ValueError, "while_loop"),
        ({"ops": 3}, TypeError, "ops"),
        ({"max_depth": -1}, ValueError, "max_depth"),
        ({"on_step": 3}, TypeError, "on_step"),
        ({"where": "scan[0]"}, TypeError, "where=lambda path: path == 'scan"),
        ({"select": [0]}, TypeError, r"select=lambda leaves: leaves\[0\]"),
        ({"select_ys": "y"}, TypeError, r"select_ys=lambda ys: ys\[0\]"),
        ({"backward": "yes"}, TypeError, "backward"),
        ({"alert": "x"}, TypeError, "alert"),
        ({"taps": ["sin"]}, TypeError, "tap.on"),
    ],
)
def test_bad_input_is_rejected_before_anything_runs(kwargs, exc, words):
    ran = []

    def f(x):
        ran.append(1)
        return x

    with pytest.raises(exc, match=words):
        tap.verbose(f, **kwargs)
    with pytest.raises(exc, match=words):
        tap.record(**kwargs)
    assert ran == []


def test_numpy_integers_are_accepted_as_ints():
    with tap.record(sample_every=np.int64(2), flush_every=np.int32(3), max_depth=np.uint8(0)) as rec:
        jax.lax.scan(lambda c, _: (c + 1.0, None), jnp.float32(0), None, length=5)
    assert [e.step for e in rec.events] == [0, 2, 4]


def test_numpy_bools_are_accepted_as_flags(capfd):
    for once, fails in ((np.bool_(True), 1), (np.bool_(False), 3)):
        with tap.record(alert_once=once, alert=lambda e: True) as rec:
            jax.lax.scan(lambda c, _: (c + 1.0, None), jnp.float32(0), None, length=3)
        assert len(rec) == 3 and capfd.readouterr().err.count("[tap] FAIL") == fails


@pytest.mark.parametrize("where", [lambda: True, lambda p: 1 / 0, lambda p: np.ones(2)],
                         ids=["no argument", "raises", "an array"])
def test_a_broken_where_is_an_error_not_an_untapped_run(where):
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3)[0])
    with pytest.raises(tap.TapSelectError, match="where"):
        with tap.record(where=where):
            f(jnp.float32(0))
    assert_bits(f(jnp.float32(0)), jnp.float32(3.0))


def test_a_where_that_chooses_no_loop_says_so_at_the_blocks_exit():
    # helper-45: a `where` copied from another run (library loops renumber
    # between blocks under grad) silently recorded nothing
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (jax.lax.while_loop(lambda d: d < 3.0, lambda d: d + 1.0, c),
                                                     None), x, None, length=2)[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tap.record(where=lambda p: p == "while[9]/while[1]") as missed:
            f(jnp.float32(0))
        with tap.record(where=lambda p: p == "scan[0]/while[0]") as chosen:
            f(jnp.float32(0))
        with tap.record(where=lambda p: False, taps=[tap.on("add")]) as prims_only:
            f(jnp.float32(0))
        with tap.record(where=lambda p: False) as nothing:  # no loop, by construction: nothing to say
            f(jnp.float32(0))
        sync()
    said = [str(w.message) for w in caught if issubclass(w.category, tap.TapWarning)]
    assert len(missed) == len(nothing) == 0 and len(chosen) > 0 and len(prims_only) > 0
    assert len(said) == 1 and "chose none of the loops" in said[0] and "scan[0], scan[0]/while[0]" in said[0]


def test_non_callable_f_is_rejected():
    with pytest.raises(TypeError, match="function"):
        tap.verbose(3)


def test_failing_select_says_it_was_the_select_with_shapes():
    g = tap.verbose(scan_while, on_step=print, select=lambda leaves: leaves[5])
    with pytest.raises(tap.TapSelectError) as info:
        g(*ARGS)
    text = str(info.value)
    assert "select" in text and "scan[0]" in text and "float32[]" in text
    assert "IndexError" in text
    assert info.value.__cause__ is None


def test_a_select_result_jax_cannot_flatten_is_a_select_error_not_an_untapped_run():
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3)[0])
    with pytest.raises(tap.TapSelectError, match="select.*cannot flatten.*scan\\[0\\].*keys sort"):
        with tap.record(select=lambda leaves: {1: leaves[0], "a": leaves[0]}):
            f(jnp.float32(0))


# ------------------------------------------------------------------ totality
class Unrebuildable:
    def __init__(self, v):
        self.v = v


jax.tree_util.register_pytree_node(
    Unrebuildable, lambda u: ((u.v,), None), lambda aux, ch: (_ for _ in ()).throw(RuntimeError("no"))
)


def test_select_result_the_host_cannot_rebuild_warns_once_and_changes_nothing():
    expected = scan_while(*ARGS)
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sync(tap.verbose(scan_while, on_step=seen.append, select=lambda leaves: Unrebuildable(leaves[0]))(*ARGS))
    assert_bits(out, expected)
    assert seen == []
    assert len([w for w in caught if issubclass(w.category, tap.TapWarning)]) == 1


def test_each_block_of_equal_options_hears_of_a_select_it_cannot_rebuild():
    # equal blocks share one compiled program and its guard: the second
    # block must still warn (it records nothing either)
    select = lambda leaves: Unrebuildable(leaves[0])  # noqa: E731
    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=4)[0])
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tap.record(select=select) as rec:
                sync(f(jnp.float32(0)))
        assert len(rec) == 0
        assert len([w for w in caught if issubclass(w.category, tap.TapWarning)]) == 1


class _BadTruth:
    def __bool__(self):
        raise SystemExit("no truth")  # not an Exception


class _BadText(str):
    def __format__(self, spec):
        raise ValueError("cannot format")


@pytest.mark.parametrize("verdict", [lambda e: np.array([1, 2]), lambda e: _BadTruth(), lambda e: _BadText("x")],
                         ids=["an array", "bool raises SystemExit", "a str that cannot format"])
def test_alert_whose_result_cannot_be_used(verdict):
    # the alert's own failure: one warning naming it; every consumer still gets every event
    expected = scan_while(*ARGS)
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sync(tap.verbose(scan_while, on_step=seen.append, alert=verdict)(*ARGS))
    assert_bits(out, expected)
    assert len(seen) == 4 + 12
    (message,) = [str(w.message) for w in caught if issubclass(w.category, tap.TapWarning)]
    assert "alert" in message


def test_totality_under_W_error_with_closed_stderr():
    proc = run_python(
        """
        import sys, jax, jax.numpy as jnp, numpy as np
        import jaxtap as tap
        def f(x):
            return jax.lax.scan(lambda c, _: (c + 1.0, c), x, None, length=5)
        expected = f(jnp.float32(0.0))
        class Bad:
            pass
        def boom(e):
            raise RuntimeError("x")
        out = tap.verbose(f, on_step=boom, alert=lambda e: "fires", select=lambda l: l[0])(jnp.float32(0.0))
        jax.block_until_ready(out); jax.effects_barrier()
        sys.stderr.close()
        out2 = tap.verbose(f, on_step=boom, alert=lambda e: "fires")(jnp.float32(0.0))
        jax.block_until_ready(out2); jax.effects_barrier()
        same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                   for o in (out, out2) for a, b in zip(jax.tree.leaves(o), jax.tree.leaves(expected)))
        print("SAME", same)
        """,
        "-W", "error",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SAME True" in proc.stdout


def test_a_stderr_whose_write_raises_system_exit_never_reaches_the_program():
    # jax-tap's own lines ([tap] prints, warnings as lines) go to a stream
    # that raises SystemExit (a wrapper aborting on a broken pipe): the
    # untapped program never writes there, so the tapped one must run on.
    proc = run_python(
        """
        import sys, jax, jax.numpy as jnp
        import jaxtap as tap
        class Stream:
            def write(self, s): raise SystemExit("stream closed")
            def flush(self): pass
        f = lambda x: jax.lax.scan(lambda c, _: (jnp.sin(c) + 1.0, None), x, None, length=3)[0]
        expected = f(jnp.float32(0.5))
        real, sys.stderr = sys.stderr, Stream()
        with tap.record(taps=[tap.print("sin")], on_step=lambda e: 1 / 0):
            out = f(jnp.float32(0.5))
        sys.stderr = real
        print("SAME", float(out) == float(expected))
        """,
        "-W", "error",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SAME True" in proc.stdout


# ------------------------------------------------- short loops (a known gap)
_SHORT_LOOP = ("known boundary (README, Short loops with a known trip count): XLA knows an untapped short "
               "loop's trip count and compiles it otherwise than a runner, whose stop is a run-time value; "
               "measured 1 ulp on this CPU", False)


def _short_fori(x):
    # a fori_loop with static bounds, a few steps, its counter in the arithmetic
    def body(i, x):
        return x * 0.97 + jnp.sin(x) * 0.05 + 0.3 * (jnp.sum(x) * 0.01 + i * 0.1)

    return jax.lax.fori_loop(0, 5, body, x)


def _one_trip_line_search(x):
    # an outer while loop of one trip holding a backtracking line search
    def rosen(x):
        return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)

    def body(c):
        p, it = c
        v, g = jax.value_and_grad(rosen)(p)

        def cond(s):
            return (rosen(p - s[0] * g) > v - 1e-4 * s[0] * jnp.dot(g, g)) & (s[1] < 30)

        t, _ = jax.lax.while_loop(cond, lambda s: (s[0] * 0.5, s[1] + 1), (jnp.float32(1.0), 0))
        return p - t * g, it + 1

    return jax.lax.while_loop(lambda c: c[1] < 1, body, (x, 0))[0]


_XS37 = np.linspace(0.1, 2.0, 37, dtype=np.float32)


def _bf16_scan_37_steps(x):
    # bfloat16[6] carry, 37 steps over constant xs, its ys stacked (helper-33):
    # on JAX 0.10.2 the untapped program departs from op-by-op evaluation by
    # up to 2 bf16 ulps, the tapped one does not (same fusions in both HLOs)
    xs = jnp.asarray(_XS37)
    c0 = (jnp.ones(6) * x).astype(jnp.bfloat16)
    return jax.lax.scan(lambda c, v: (c * v.astype(jnp.bfloat16) + jnp.bfloat16(0.7), c), c0, xs)


def _fori_17_steps(v):
    # helper-43's fuzzer: 12 to 30 static steps move too (40 and 50 do not)
    return jax.lax.fori_loop(0, 17, lambda i, v: v * 0.9 + 0.1 * (jnp.sum(v) * 0.1 + i.astype(jnp.float32) * 0.01), v)


_SHORT = {"fori_5_steps": (_short_fori, jnp.linspace(0.1, 1.3, 6, dtype=jnp.float32).reshape(2, 3), {}),
          "fori_17_steps": (_fori_17_steps, jnp.asarray(np.random.RandomState(2008).randn(3).astype(np.float32)) * 0.3,
                            {"max_depth": 0}),
          "one_trip_outer_only": (_one_trip_line_search, jnp.array([-1.2, 1.0, 0.5, -0.3, 0.8]), {"max_depth": 0}),
          "bf16_37_steps": (_bf16_scan_37_steps, jnp.float32(0.3), {})}
# scans of at most 32 steps (a fori_loop with static bounds is one) run as
# written since 0.10.14, a tapped copy beside them (README, Loops that run twice)
_SHORT_GAPS = {name: None if name.startswith("fori") else _SHORT_LOOP for name in _SHORT}
if tap_seam.JAX_VERSION >= (0, 11):
    _SHORT_GAPS["bf16_37_steps"] = None  # bitwise there (JAX 0.12.0.1)


@pytest.mark.parametrize("name", list(cases(_SHORT_GAPS)))
def test_short_jitted_loops_with_a_known_trip_count(name):
    """Found by two helpers (a fuzzer; an optax L-BFGS of one iteration):
    carry taps alone move these by an ulp under jit (eagerly, bitwise)."""
    fn, x, cfg = _SHORT[name]
    f = jax.jit(fn)
    plain = f(x)
    with tap.record(**cfg) as rec:
        out = f(x)
    assert len(rec) > 0
    assert_bits(out, plain)


# --------------------------------------------------------------------- vmap
_YS_LANE_FIRST = ("known boundary (README, A scan's ys under vmap): under vmap the runner's ys buffer, carried by a "
                  "while loop, is laid out lane-first, JAX's own scan stacks ys step-first; a sum over the steps "
                  "adds in another order on this CPU (2 ulps here)", False)


@pytest.mark.parametrize("length", [pytest.param(17, marks=pytest.mark.xfail(strict=False, reason=_YS_LANE_FIRST[0])),
                                    12])
def test_vmap_of_a_scan_whose_ys_are_summed_over_its_steps(length):
    # helper-43's fuzzer: jit(vmap(f)), f a 17-step tanh scan whose ys are
    # summed; the ys themselves are bitwise, and so is f without vmap
    def f(c0):
        _, ys = jax.lax.scan(lambda c, _: (c * 0.5 + 0.1 * jnp.tanh(c * 1.3),) * 2, c0, None, length=length)
        return jnp.sum(ys), ys

    w = jnp.asarray(np.random.RandomState(5049).randn(3, 3).astype(np.float32)) * 0.3
    fn = jax.jit(jax.vmap(f))
    plain = fn(w)
    with tap.record() as rec:
        out = sync(fn(w))
    assert len(rec) == 3 * length
    assert_bits(out[1], plain[1])
    assert_bits(out[0], plain[0])


def test_vmap_of_verbose_and_verbose_of_vmap_with_while_loops():
    def f(x):
        return jax.lax.while_loop(lambda s: s[1] < 10.0, lambda s: (s[0] + 1, s[1] * 2.0 + 1.0), (0, x))

    xs = jnp.array([0.0, 3.0, 9.5], jnp.float32)
    expected = jax.vmap(f)(xs)
    outer = []
    assert_bits(sync(jax.vmap(tap.verbose(f, on_step=outer.append, select=lambda l: l[1]))(xs)), expected)
    inner = []
    assert_bits(sync(tap.verbose(jax.vmap(f), on_step=inner.append, select=lambda l: l[1]))(xs), expected)
    # per-lane steps: lane 0 runs 4 steps (1, 3, 7, 15), lane 1 runs 2 (7, 15), lane 2 one (20)
    assert sorted(float(e.value) for e in outer) == [1.0, 3.0, 7.0, 7.0, 15.0, 15.0, 20.0]
    # the wrapper runs vmap(f) as written: the loop is tapped where f binds
    # it, lane by lane, as in vmap(verbose(f)) and in a with-block
    key = lambda e: (e.lane, e.step)
    assert [(e.path, e.step, e.lane, float(e.value)) for e in sorted(inner, key=key)] == \
        [(e.path, e.step, e.lane, float(e.value)) for e in sorted(outer, key=key)]
    with tap.record(select=lambda l: l[1]) as rec:
        assert_bits(sync(jax.vmap(f)(xs)), expected)
    assert sorted(rec.events, key=key) == sorted(inner, key=key)


def test_vmap_ships_all_lanes_in_one_hop_per_step(monkeypatch):
    from jaxtap import _emit

    hops = []
    real = _emit._unpack

    def counting(buf, layout):
        hops.append(np.shape(buf)[:-1])
        return real(buf, layout)

    monkeypatch.setattr(_emit, "_unpack", counting)

    def f(x):  # (40 steps: a shorter scan also runs as written, its copy's check one hop more)
        return jax.lax.scan(lambda c, _: (c * 0.5 + 1.0, None), x, None, length=40)[0]

    xs = jnp.arange(8, dtype=jnp.float32)
    seen = []
    out = sync(jax.vmap(tap.verbose(f, on_step=seen.append, select=lambda l: l[0]))(xs))
    assert_bits(out, jax.vmap(f)(xs))
    assert hops == [(8,)] * 40  # one packed operand carrying 8 lanes per step
    assert sorted((e.step, e.lane) for e in seen) == [(s, lane) for s in range(40) for lane in range(8)]
    by = {(e.step, e.lane): float(e.value) for e in seen}
    assert by[(0, 3)] == 3 * 0.5 + 1.0


def test_vmapped_while_lanes_that_finished_emit_nothing():
    def f(x):
        return jax.lax.while_loop(lambda s: s < 10.0, lambda s: s + 4.0, x)

    xs = jnp.array([0.0, 5.0, 9.0], jnp.float32)
    seen = []
    sync(jax.vmap(tap.verbose(f, on_step=seen.append, select=lambda l: l[0]))(xs))
    per_lane = {lane: [float(e.value) for e in seen if e.lane == lane] for lane in range(3)}
    assert per_lane == {0: [4.0, 8.0, 12.0], 1: [9.0, 13.0], 2: [13.0]}


@pytest.mark.parametrize("length", [0, 1, 2])
def test_short_scans_are_identical_and_observed(length):
    def f(a, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(c * 1.25 + x) + 0.1 * jnp.sin(c), c - x), a, xs)

    a = jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32)
    xs = jnp.ones((length, 128), jnp.float32) * 0.3
    seen = []
    assert_bits(sync(jax.jit(tap.verbose(f, on_step=seen.append, on_ys=seen.append))(a, xs)), jax.jit(f)(a, xs))
    assert len(seen) == 2 * length


def test_verbose_takes_fs_eager_only_branches_and_reads_its_globals_live():
    """numpyro skips a loop when its key is concrete: f's Python runs as written."""
    scale = {"k": 2.0}

    def f(x):
        if not isinstance(x, jax.core.Tracer):  # eager only: no loop at all
            return x * scale["k"]
        return jax.lax.scan(lambda c, _: (c * scale["k"], None), x, None, length=1)[0]

    seen = []
    g = tap.verbose(f, on_step=seen.append)
    assert float(g(jnp.float32(1.5))) == 3.0 and seen == []
    scale["k"] = 3.0
    assert float(g(jnp.float32(1.5))) == 4.5 and seen == []
    assert float(sync(jax.jit(g)(jnp.float32(1.5)))) == 4.5 and [e.path for e in seen] == ["scan[0]"]


def test_disable_jit_runs_f_as_it_would_run():
    def f(x):
        return jax.lax.while_loop(lambda c: c < 3.0, lambda c: c * 1.7 + 0.1, x)

    with jax.disable_jit():
        expected = f(jnp.float32(0.5))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            out = tap.verbose(f, on_step=print)(jnp.float32(0.5))
    assert_bits(out, expected)


def test_wrapped_callables_attributes_never_shadow_ours():
    """Equinox's filter_jit, flax transforms, partials and callable objects
    carry a __dict__ (filter_jit's `_signature` once shadowed our method);
    their attributes show through without replacing jax-tap's own."""
    import functools

    class Wrapper:
        def __init__(self, fn):
            self.fn, self._signature, self._build, self._cache, self.__call__ = fn, "theirs", 1, None, None
            self.note = "kept"

        def __call__(self, *a):
            return self.fn(*a)

    f = Wrapper(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3)[0])
    part = functools.partial(lambda k, x: jax.lax.scan(lambda c, _: (c * k, None), x, None, length=2)[0], 2.0)
    for fn, want in ((f, 3.0), (part, 4.0)):
        seen = []
        g = tap.verbose(fn, on_step=seen.append)
        assert float(sync(g(jnp.float32(1.0 if fn is part else 0.0)))) == want
        assert [e.path for e in seen] == ["scan[0]"] * (3 if fn is f else 2)
    assert tap.verbose(f, on_step=print).note == "kept"


def test_verbose_called_eagerly_computes_what_f_computes_eagerly():
    # jnp.mean is a jit declared inline: eagerly it is one compiled program
    # (XLA turns `/ n` into `* (1/n)`); traced, it dissolves into equations.
    # tap.verbose runs f as written, so eager values agree.
    def f(x, y):
        return jax.lax.scan(lambda c, _: (c * 1.01, None), jnp.mean(x * y + 1.0), None, length=3)[0]

    x = jax.random.normal(jax.random.key(1), (1000,))
    y = jax.random.normal(jax.random.key(2), (1000,))
    want = f(x, y)
    seen = []
    got = tap.verbose(f, on_step=seen.append)(x, y)
    jax.effects_barrier()
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert [e.step for e in seen] == [0, 1, 2]
    # under a transformation the program is traced as usual (and still agrees)
    assert np.asarray(jax.jit(tap.verbose(f))(x, y)).tobytes() == np.asarray(jax.jit(f)(x, y)).tobytes()


def test_a_generator_function_is_tapped_as_it_is_iterated():
    def gen(x, n):
        for _ in range(n):
            x = jax.lax.scan(lambda c, _: (c * 1.5, None), x, None, length=2)[0]
            yield x

    seen = []
    got = list(tap.verbose(gen, on_step=seen.append, select=lambda leaves: ())(jnp.float32(1.0), 3))
    assert_bits(got, list(gen(jnp.float32(1.0), 3)))
    sync()
    assert [(e.path, e.step) for e in seen] == [("scan[0]", 0), ("scan[0]", 1)] * 3


@pytest.mark.parametrize("flush_every", [None, 2])
@pytest.mark.parametrize("dtype", ["int4", "uint4", "float4_e2m1fn"])
def test_sub_byte_carries_cross_with_their_values_and_dtype(dtype, flush_every):
    dt = getattr(jnp, dtype)
    x0 = jnp.array([[1, 2, 0, 1], [3, 1, 2, 0]], dt)

    def f(c):
        return jax.lax.scan(lambda c, _: (c + x0, c), c, None, length=3)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ran untapped" warning
        with tap.record(flush_every=flush_every, select_ys=lambda ys: ys[0]) as rec:
            out = jax.jit(f)(x0)
            sync()
    assert_bits(out, jax.jit(f)(x0))
    carries = [e.value[0] for e in rec.events if e.kind == "carry"]
    assert [e.step for e in rec.events if e.kind == "carry"] == [0, 1, 2]
    assert all(v.dtype == np.dtype(dt) for v in carries)
    final, stacked = out
    expected = list(np.asarray(stacked)[1:]) + [np.asarray(final)]  # the carry after each step
    assert all(np.array_equal(v.view(np.uint8), e.view(np.uint8)) for v, e in zip(carries, expected))
    ys = [e.value for e in rec.events if e.kind == "output"]
    assert len(ys) == 3 and np.array_equal(ys[0].astype(np.float32), np.asarray(x0).astype(np.float32))


@pytest.mark.parametrize("form", ["scan", "while", "buffered", "vmap"])
def test_a_float0_carry_leaf_crosses_as_zeros(form, tmp_path):
    # a gradient of an int leaf (jax.grad(..., allow_int=True)) is float0: it
    # has no data, and a carry holding one used to crash the tapped program
    # (helper-44: JAX's bitcast refuses float0)
    g = jax.grad(lambda p: p["w"] * p["n"].astype(jnp.float32), allow_int=True)(
        {"w": jnp.float32(2.0), "n": jnp.int32(3)})

    def f(w, g):
        if form == "while":
            return jax.lax.while_loop(lambda c: c[0] > 1.0, lambda c: (c[0] - 0.3 * c[1]["w"], c[1]), (w, g))
        return jax.lax.scan(lambda c, _: ((c[0] - 0.1 * c[1]["w"], c[1]), c[0]), (w, g), None, length=3)

    run, w = (jax.vmap(f, in_axes=(0, None)), jnp.ones(2) * 2) if form == "vmap" else (jax.jit(f), jnp.float32(2.0))
    path = tmp_path / "run.jsonl"
    with warnings.catch_warnings(), tap.JSONLWriter(path) as writer:
        warnings.simplefilter("error")  # tapped, not "ran untapped"
        with tap.record(flush_every=2 if form == "buffered" else None, on_step=writer) as rec:
            out = run(w, g)
            sync()
    assert_bits(out, run(w, g))
    carries = [e.value for e in rec.events if e.kind == "carry"]
    assert len(carries) == {"while": 2, "vmap": 6}.get(form, 3)
    assert all(v[1].dtype == jax.dtypes.float0 and v[1].shape == () for v in carries)
    back = [e.value for e in tap.read_jsonl(str(path)) if e.kind == "carry"]
    assert [v[1].dtype for v in back] == [jax.dtypes.float0] * len(carries)
    assert [float(v[0]) for v in back] == [float(v[0]) for v in carries]


def _passes_params_through(kind):
    """A loop whose body returns a carry leaf unchanged (JAX's front end moves
    it out of the carry) and, for a scan, an output that repeats its xs."""
    def f(p0, x0):
        if kind == "scan":
            def body(carry, x):
                params, v = carry
                return (params, v * params + x), (x, v * 2.0)
            return jax.lax.scan(body, (p0, x0), jnp.arange(3.0))
        return jax.lax.while_loop(lambda s: s[1] < 300.0, lambda s: (s[0], s[1] * s[0] + 1.0), (p0, x0))
    return f


@pytest.mark.parametrize("form", ["eager", "jit", "vmap", "nested", "buffered"])
@pytest.mark.parametrize("kind", ["scan", "while"])
def test_select_sees_carry_leaves_the_body_returns_unchanged(kind, form):
    f = _passes_params_through(kind)
    args = (jnp.float32(7.0), jnp.float32(0.0))
    run, opts = f, {}
    if form == "jit":
        run = jax.jit(f)
    elif form == "vmap":
        run, args = jax.vmap(f), (jnp.full(2, 7.0), jnp.zeros(2))
    elif form == "nested":
        run = jax.jit(lambda p, x: jax.lax.scan(lambda c, _: (f(p, c)[0][1] if kind == "scan" else f(p, c)[1],
                                                                None), x, None, length=2)[0])
    elif form == "buffered":
        opts = {"flush_every": 2}
    with tap.record(select=lambda leaves: leaves, select_ys=lambda ys: ys, **opts) as rec:
        out = run(*args)
        sync()
    assert_bits(out, run(*args))
    inner = "scan[0]/" + kind + "[0]" if form == "nested" else kind + "[0]"
    carries = [e.value for e in rec.events if e.kind == "carry" and e.path == inner]
    assert carries and all(len(c) == 2 for c in carries)
    assert all(np.all(np.asarray(c[0]) == 7.0) for c in carries)  # the parameter, where the body returns it
    if kind == "scan" and form != "nested":
        ys = [e.value for e in rec.events if e.kind == "output" and e.lane in (None, 0)]
        assert len(ys) == 3 and all(len(y) == 2 for y in ys)
        assert [float(np.ravel(y[0])[0]) for y in ys] == [0.0, 1.0, 2.0]  # the output that repeats xs


def test_a_tapped_while_loop_runs_cond_fun_at_most_three_times_a_step():
    """Documented boundary (README, Known boundaries): side effects in
    cond_fun repeat, at most three times per step; the result is unchanged."""
    from jax.experimental import io_callback

    log = []

    def cond(s):
        io_callback(lambda i: log.append(int(i)), None, s[0], ordered=True)
        return s[0] < 3

    f = jax.jit(lambda x: jax.lax.while_loop(cond, lambda s: (s[0] + 1, s[1] * 1.1), (0, x)))
    plain = f(jnp.float32(1.0))
    jax.effects_barrier()
    untapped, log[:] = list(log), []
    with tap.record(select=lambda _: ()) as rec:
        out = f(jnp.float32(1.0))
        sync()
    assert_bits(out, plain)
    assert untapped == [0, 1, 2, 3] and sorted(set(log)) == untapped and len(log) <= 3 * 3 + 1
    assert [e.step for e in rec.events] == [0, 1, 2]


def test_a_consumer_exception_that_cannot_be_printed():
    # (in a child: formatting it where the warning is built used to abort the process on JAX 0.10)
    proc = run_python("""
        import warnings, jax, jax.numpy as jnp, jaxtap as tap
        class Evil(Exception):
            def __str__(self):
                raise Evil()
            __repr__ = __str__
        def consumer(e):
            raise Evil()
        f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=5)[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tap.record(on_step=consumer) as rec:
                out = f(jnp.float32(0)).block_until_ready()
        print(float(out), len(rec), [str(w.message)[:60] for w in caught])
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "5.0 5 ['jax-tap: the on_step callback consumer raised Evil (its mess']"


def test_a_failing_consumer_whose_attributes_raise_is_still_named_as_itself():
    class Weird:
        def __call__(self, e):
            raise ValueError("consumer failure")

        def __getattr__(self, name):
            raise KeyError(name)

    f = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1.0, None), x, None, length=3)[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tap.record(on_step=Weird()) as rec:
            out = sync(f(jnp.float32(0)))
    assert float(out) == 3.0 and len(rec) == 3
    (message,) = [str(w.message) for w in caught if issubclass(w.category, tap.TapWarning)]
    assert "the on_step callback" in message and "Weird object" in message and "ValueError: consumer failure" in message


WRAP_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp, jaxtap as tap
from jaxtap import _driver
_driver._FIRST_STEP = np.int32(2**31 - {before})  # as if {before} steps before the int32 wrap
def f(x):
    return jax.lax.while_loop(lambda c: c[0] < 12, lambda c: (c[0] + 1, c[1] * 1.01 + 0.5), (0, x))
plain = jax.jit(f)(jnp.float32(1.0))
with tap.record(sample_every={every}, flush_every={flush}) as rec:
    out = jax.jit(f)(jnp.float32(1.0))
assert np.asarray(out[1]).tobytes() == np.asarray(plain[1]).tobytes()
print([(e.step, int(e.value[0])) for e in rec.events])
"""


@pytest.mark.parametrize("every,flush", [(1, None), (3, None), (1, 4), (5, 4)])
def test_a_while_loop_crossing_the_int32_step_wrap_finishes(every, flush):
    # steps count in int32; a loop past 2**31-1 steps hung (its next stop
    # overflowed) or lost the step at the wrap. Started 5 steps before the
    # wrap: it finishes, bitwise, and each sampled step arrives once, steps
    # numbered modulo 2**32 (negative past the wrap; sample_every counts there)
    proc = run_python(WRAP_SCRIPT.format(before=5, every=every, flush=flush), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.errstate(over="ignore"):
        steps = np.int32(2**31 - 5) + np.arange(12, dtype=np.int32)
    want = [(int(s), c + 1) for c, s in enumerate(steps) if np.fmod(s, every) == 0]
    assert proc.stdout.strip() == str(want)


@pytest.mark.parametrize("flush_every", [None, 4])
@pytest.mark.parametrize("wrap", ["eager", "jit", "vmap"])
def test_weakly_typed_scan_outputs_stay_weak_so_later_dtypes_do_not_change(wrap, flush_every):
    """A scan's ys from a Python-scalar carry (or a constant y) are weakly
    typed; the lens once built them strong in the runner's buffer, and
    ``ys * bf16`` became float32 instead of bfloat16 (helper-33)."""
    xs = jnp.linspace(0.1, 2.0, 41, dtype=jnp.float32)

    def f(h):
        c, ys = jax.lax.scan(lambda c, v: (c + jnp.sin(v) * 0.5, c), 0.0, xs)
        _, ints = jax.lax.scan(lambda c, v: (c + 1, c), 0, xs)
        _, const = jax.lax.scan(lambda c, v: (c + v, 2.0), jnp.float32(0), xs)
        return ys * h, ints + jnp.int8(1), const * h, jax.lax.map(lambda v: 2.0, xs) * h

    g = {"eager": f, "jit": jax.jit(f), "vmap": jax.vmap(f)}[wrap]
    h = jnp.ones((3, 41) if wrap == "vmap" else 41, jnp.bfloat16)
    ref = g(h)
    with tap.record(flush_every=flush_every) as rec:
        got = g(h)
    assert [r.dtype for r in ref] == [jnp.bfloat16, jnp.int8, jnp.bfloat16, jnp.bfloat16]
    assert [x.dtype for x in got] == [r.dtype for r in ref]
    assert_bits(ref, got)
    assert len(rec.events) >= 4 * 41


def test_a_default_select_that_ships_a_large_carry_every_step_warns_once():
    """A solver's output buffer in the carry (diffrax SaveAt(steps=True)):
    without a select each step ships all of it and a recorder keeps every
    copy (helper-32: 1,500 steps of a 375 KiB carry took 2.6 GB). The lens
    says so once while tracing; a select, or a small carry, is quiet."""
    def f(x, n=600):
        def body(c, i):
            buf, s = c
            s = s * 0.99 + 1.0
            return (buf.at[i].set(s), s), None
        return jax.lax.scan(body, (jnp.zeros((n, 128)), x), jnp.arange(n))[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tap.record() as rec:
            jax.jit(f)(jnp.ones(128))
        plain = jax.jit(f)(jnp.ones(128))
        with tap.record(select=lambda leaves: leaves[1]) as picked:
            assert_bits(jax.jit(f)(jnp.ones(128)), plain)
        with tap.record() as small:
            jax.jit(functools.partial(f, n=100))(jnp.ones(128))
    large = [str(w.message) for w in caught if "KiB" in str(w.message)]
    assert len(large) == 1 and "'scan[0]'" in large[0] and "300 KiB" in large[0] and "select=" in large[0]
    assert len(rec) == len(picked) == 600 and len(small) == 100

    # what crosses is what counts (helper-34): a PRNG key leaf beside a large
    # buffer still warns; a backward loop's parameter cotangents (a large W
    # closed over, never shipped) do not
    def keyed(k, x):
        return jax.lax.scan(lambda c, _: ((jax.random.split(c[0])[0], c[1] * 0.5), None), (k, x), None, length=3)[0]

    def loss(w, x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(w @ c), None), x, None, length=3)[0].sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tap.record():
            keyed(jax.random.key(0), jnp.ones((512, 256)))
        with tap.record(backward=True):
            jax.grad(loss, argnums=(0, 1))(jnp.ones((300, 300)) * 1e-3, jnp.ones(300))
    assert [str(w.message).split(" every step")[0] for w in caught if "KiB" in str(w.message)] == \
        ["jax-tap: the tap at 'scan[0]' ships all its carry leaves"]


def test_unbuffered_taps_deliver_every_step_before_the_program_fails_in_the_loop():
    """A runtime failure inside a loop (the user's callback raising at step
    3, as eqx.error_if does): the steps before it reached the host."""
    def check(i):
        if i == 3:
            raise ValueError("bad step")

    def f(x):
        def body(c):
            jax.debug.callback(check, c[0])
            return c[0] + 1, c[1] * 2.0
        return jax.lax.while_loop(lambda c: c[0] < 10, body, (0, x))

    with tap.record(select=lambda leaves: leaves[0]) as rec:
        with pytest.raises(Exception, match="bad step"):
            jax.block_until_ready(jax.jit(f)(jnp.float32(1.0)))
    assert [int(e.value) for e in rec.events] == [1, 2, 3]
