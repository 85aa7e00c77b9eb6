#!/bin/bash
# One GPU check in one call (the device tool: a CUDA machine whose image has
# JAX, equinox, diffrax, lineax, optax, numpyro; blackjax and orjson travel as
# wheels in .whl/). Identity first, then overhead; each part has its own
# time limit so that a slow part cannot take the others' results with it.
#
#   bash bench/gpu_check.sh            # results under $OUT (or /tmp/gpu_check)
#
# 2026-12-05, an H100 with JAX 0.11.2: a run with JAX_PLATFORMS=cuda found
# every hop dropped (fixed in 0.10.10); the next run, 12 test workers, lost
# the machine before it reported (cause unknown): 6 workers by default now.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS="${PLATFORM:-cuda,cpu}"
{ nvidia-smi -L; nproc; python3 -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())"; } \
  2>&1 | tee "$OUT/env.txt"

# identity (tapped vs untapped, bit for bit) on the GPU: the corpus, the core,
# the transforms around loops, buffered delivery, real libraries
timeout "${TESTS_S:-250}" python3 -m pytest -v -p no:cacheprovider -o addopts="" -n "${WORKERS:-6}" -rfxX \
  tests/test_identity_corpus.py tests/test_core.py tests/test_grad_forms.py tests/test_transforms_around.py \
  tests/test_buffered.py tests/test_libraries.py tests/test_lanes.py tests/test_ytaps.py tests/test_nan_birth.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"
echo "PASSED lines: $(grep -c ' PASSED ' "$OUT/tests.log")  XFAIL lines: $(grep -c ' XFAIL ' "$OUT/tests.log")"
grep -E " FAILED | ERROR | XPASS |^FAILED|^ERROR| passed| failed|rc=" "$OUT/tests.log" | tail -40

# JAX without a CPU backend: the hops must still deliver
JAX_PLATFORMS=cuda timeout "${NOCPU_S:-45}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -n "${WORKERS:-6}" \
  tests/test_core.py > "$OUT/nocpu.log" 2>&1
echo "no-cpu tests rc=$?" >> "$OUT/nocpu.log"
tail -5 "$OUT/nocpu.log"

# overhead: the per-step arms against the bare program and the floor
timeout "${BENCH_S:-80}" python3 bench/bench.py --smoke --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
tail -45 "$OUT/bench.log"

# a real program (BlackJAX NUTS and an optax loop), plain vs the defaults
timeout "${REAL_S:-110}" python3 bench/real_program.py --arms "defaults,select" > "$OUT/real.log" 2>&1
echo "real rc=$?" >> "$OUT/real.log"
cat "$OUT/real.log"
