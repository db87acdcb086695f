#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (about 12 minutes on one data-centre GPU):
#   1. the engine's tests on the GPU: device placement, greedy ids and seeded samples equal to the
#      CPU's, and the lossless-decoding tests (tests/engine/test_speculative.py, test_reproducible.py);
#   2. forward time per step shape at 16 and 64 samples (experiments/layout.py);
#   3. the speedup speculation could reach there at all (benchmarks/bench_ceiling.py: step cost
#      per draft length in every cell, against perfect, target-greedy and consensus drafts);
#   4. the speculative decoding benchmark on the GPU (benchmarks/bench_spec.py), as many of its
#      cells as finish within FULL_TIMEOUT seconds (default 300).
# Everything lands in $RESULTS (default results/gpu). Run from the repository root with the
# project's dependencies and the default model installed (see the README):
#   bash benchmarks/gpu_check.sh
# Each part's time limit (seconds) and what the last two run can be narrowed for a shorter check:
#   TESTS_TIMEOUT=180 LAYOUT_REPEATS=5 CEILING_CELLS="4, one at a time;16, one at a time" \
#   SPEC_ARGS="--cells 4,5 --rows consensus-auto" FULL_TIMEOUT=150 bash benchmarks/gpu_check.sh
set -uo pipefail
RESULTS=${RESULTS:-results/gpu}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MULTISPEC_NO_PROGRESS=1
"$PY" -c "
import sys, torch
if not torch.cuda.is_available():
    sys.exit('gpu_check: no CUDA GPU visible to torch')
print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))
" || exit 1

status=0
echo "== tests on cuda"
MULTISPEC_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_device.py tests/engine/test_speculative.py tests/engine/test_reproducible.py 2>&1 \
    | tee "$RESULTS/tests.log" || status=1

echo "== forward time per step shape"
for batch in 16 64; do
    timeout "${LAYOUT_TIMEOUT:-120}" "$PY" experiments/layout.py --device cuda --batch "$batch" \
        --repeats "${LAYOUT_REPEATS:-10}" \
        2>&1 | tee "$RESULTS/layout_$batch.txt" || status=1
done

echo "== ceiling: step cost per draft length"
timeout "${CEILING_TIMEOUT:-300}" "$PY" benchmarks/bench_ceiling.py --device cuda --seeds 0 \
    --cells "${CEILING_CELLS:-4, one at a time;16, one at a time;8x4;8x16;4x64}" 2>&1 | tee "$RESULTS/ceiling.txt" || status=1

echo "== speculative decoding benchmark"
# The full table, saved cell by cell: what finishes before the timeout is kept and drawn.
timeout "${FULL_TIMEOUT:-300}" "$PY" benchmarks/bench_spec.py --device cuda --out "$RESULTS/bench_spec.json" ${SPEC_ARGS:-} \
    >"$RESULTS/bench_spec_full.log" 2>&1 || echo "full benchmark stopped early (exit $?); keeping finished cells"
"$PY" benchmarks/bench_spec.py --from-json "$RESULTS/bench_spec.json" --plot "$RESULTS/spec_speedup.png" \
    2>&1 | tee "$RESULTS/bench_spec.md" || status=1
exit $status
