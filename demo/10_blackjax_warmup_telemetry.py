"""10 - BlackJAX window adaptation, watched live (the flagship).

The story: `blackjax.window_adaptation(blackjax.nuts, logdensity).run(...)`
is one call. It returns the tuned step size and inverse mass matrix at the
end, and nothing about how it got there: did the metric settle, was the
acceptance rate on target in every window, is 300 warmup steps enough for a
target whose scales span 100x? Answering that used to mean copying
BlackJAX's adaptation loop into your own code and threading debug fields
through its carry.

jax-tap, with BlackJAX unmodified:
  * the adaptation scan's carry leaves are located once by structure
    (BlackJAX's public state types give the leaf order; one probe event's
    shapes confirm it), then a `select` ships only the step sizes and the
    two inverse-mass-matrix leaves, and `select_ys` ships the per-step
    NUTS acceptance rate from the scan's outputs;
  * `on_step` prints one line per adaptation window, live, as the metric
    changes; `max_depth=0` leaves NUTS's inner while loops untapped;
  * cross-check: the final step size and inverse mass matrix that `.run()`
    returns equal (bitwise) what the last streamed event carried, and the
    tapped run is bitwise the untapped one;
  * `blackjax.progress_bar()`, which BlackJAX builds on this package, runs
    on top of it and counts every step.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import blackjax
import jaxtap as tap
from blackjax.adaptation.step_size import DualAveragingAdaptationState

NUM_STEPS = 300
VARIANCES = jnp.array([100.0, 1.0, 0.01])


def logdensity(x):
    return -0.5 * jnp.sum(x**2 / VARIANCES)


def locate_leaves(x0):
    """Leaf indices by name, from BlackJAX's public types (nothing runs).

    The scan carry is (HMCState, WindowAdaptationState(ss_state, imm_state,
    step_size, inverse_mass_matrix)); its outputs are AdaptationInfo(state,
    info, adaptation_state)."""
    state = blackjax.nuts.init(x0, logdensity)
    n_state = len(jax.tree_util.tree_leaves(state))
    ss = DualAveragingAdaptationState._fields
    kernel = blackjax.nuts.build_kernel()
    _, info = jax.eval_shape(lambda s: kernel(jax.random.key(0), s, logdensity, 1.0, jnp.ones_like(x0)), state)
    info_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(info)[0]]
    carry = {"log_step_size_avg": n_state + ss.index("log_step_size_avg"),
             "imm_final": n_state + len(ss),        # imm_state.inverse_mass_matrix, first leaf of imm_state
             "step_size": -2, "inverse_mass_matrix": -1}   # the state's last two fields
    return carry, n_state + info_paths.index(".acceptance_rate")


def main():
    sys.stdout.reconfigure(line_buffering=True)
    key, x0 = jax.random.key(0), jnp.ones(3)
    warmup = blackjax.window_adaptation(blackjax.nuts, logdensity)
    (state, params), info = warmup.run(key, x0, num_steps=NUM_STEPS)
    print(f"warmup.run: step size {float(params['step_size']):.3f}, inverse mass matrix "
          f"{np.round(np.asarray(params['inverse_mass_matrix']), 4)} (true variances {np.asarray(VARIANCES)})")
    print("  <- converged? on target in every window? the call does not say")

    leaf, i_acc = locate_leaves(x0)
    with tap.record(max_depth=0, sample_every=NUM_STEPS) as probe:     # one event: step 0, all leaves
        warmup.run(key, x0, num_steps=NUM_STEPS)
    shapes = [np.shape(v) for v in probe.events[0].value]
    structure_ok = (shapes[leaf["log_step_size_avg"]] == () and shapes[leaf["imm_final"]] == (3,)
                    and shapes[leaf["step_size"]] == () and shapes[leaf["inverse_mass_matrix"]] == (3,))
    print(f"probe: the adaptation carry has {len(shapes)} leaves {shapes}; chosen {leaf}: "
          f"shapes agree: {structure_ok}")

    def select(leaves):
        return {k: leaves[i] for k, i in leaf.items()}

    acc, windows = [], []

    def on_step(e):
        imm = e.value["inverse_mass_matrix"]
        if not windows or not np.array_equal(imm, windows[-1][1]) or e.step == e.total - 1:
            a = f"{np.mean(acc[windows[-1][0] + 1:]):.2f}" if windows else "-"
            windows.append((e.step, imm))
            print(f"  [live] step {e.step:3d}: step size {float(e.value['step_size']):.3f}, "
                  f"inverse mass matrix {np.round(imm, 4)}, mean acceptance since the last line {a}")

    print("streaming the adaptation scan (one line per metric update):")
    with tap.record(select=select, select_ys=lambda ys: ys[i_acc], max_depth=0,
                    on_step=on_step, on_ys=lambda e: acc.append(float(e.value))) as rec:
        (state_t, params_t), _ = warmup.run(key, x0, num_steps=NUM_STEPS)
    carry_events = [e for e in rec.events if e.kind == "carry"]
    last = carry_events[-1].value
    step_ok = np.asarray(jnp.exp(last["log_step_size_avg"])).tobytes() == np.asarray(params["step_size"]).tobytes()
    imm_ok = np.asarray(last["imm_final"]).tobytes() == np.asarray(params["inverse_mass_matrix"]).tobytes()
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in
               zip(jax.tree_util.tree_leaves((state_t, params_t)), jax.tree_util.tree_leaves((state, params))))
    ys_ok = np.asarray(acc, np.float32).tobytes() == np.asarray(info.info.acceptance_rate).tobytes()
    print(f"{len(carry_events)} carry + {len(acc)} output events from {sorted({e.path for e in rec.events})}; "
          f"streamed acceptance == the info .run() returns: {ys_ok}")
    print(f".run()'s step size == exp(last streamed log_step_size_avg): {step_ok}; "
          f"inverse mass matrix == last streamed: {imm_ok}; tapped run bitwise identical: {same}")
    rel = np.abs(np.asarray(params["inverse_mass_matrix"]) / np.asarray(VARIANCES) - 1.0)
    print(f"metric updates seen: {len(windows) - 2}; final relative error of the metric {np.round(rel, 2)}")

    with blackjax.progress_bar(label="NUTS warmup") as bar:     # BlackJAX's bar, built on jax-tap
        (state_b, params_b), _ = warmup.run(key, x0, num_steps=NUM_STEPS)
    bar_ok = bar.n_steps == NUM_STEPS and bar.current_step == NUM_STEPS - 1
    same_b = np.asarray(params_b["step_size"]).tobytes() == np.asarray(params["step_size"]).tobytes()
    print(f"blackjax.progress_bar: counted {bar.current_step + 1}/{bar.n_steps} steps; result identical: {same_b}")

    ok = (structure_ok and step_ok and imm_ok and same and same_b and bar_ok and len(carry_events) == NUM_STEPS
          and len(acc) == NUM_STEPS and len(windows) >= 3 and {e.path for e in rec.events} == {"scan[0]"}
          and ys_ok)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
