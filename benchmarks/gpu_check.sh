#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (about 12 minutes on one data-centre GPU with the
# defaults; the settings below narrow it):
#   1. the engine's tests on the GPU: device placement, greedy ids and seeded samples equal to the
#      CPU's, and the lossless-decoding tests (tests/engine/test_speculative.py, test_reproducible.py);
#   2. forward time per step shape (experiments/layout.py, LAYOUT_BATCHES samples);
#   3. the speedup speculation could reach there at all (benchmarks/bench_ceiling.py: step cost
#      per draft length in every cell, against perfect, target-greedy and consensus drafts);
#   4. the speculative decoding benchmark on the GPU (benchmarks/bench_spec.py), as many of its
#      cells as finish within FULL_TIMEOUT seconds (default 300);
#   5. the draft-model benchmark (benchmarks/bench_draft_model.py: consensus, the draft head and
#      the hybrid against plain), as many cells as finish within DRAFT_TIMEOUT seconds.
# Everything lands in $RESULTS (default results/gpu), and in one archive $RESULTS.tar.gz. Run from
# the repository root with the project's dependencies and the default model installed (see the
# README):
#   bash benchmarks/gpu_check.sh
# Each part's time limit (seconds) and what parts 2-5 run can be narrowed for a shorter check
# (an empty LAYOUT_BATCHES or a timeout of 0 skips that part):
#   TESTS_TIMEOUT=150 LAYOUT_BATCHES= CEILING_CELLS="4, one at a time;16, one at a time" \
#   CEILING_ARGS="--repeats 1" SPEC_ARGS="--cells 4,5 --rows consensus-auto" FULL_TIMEOUT=100 \
#   DRAFT_ARGS="--cells 0 --rows consensus,model-auto,hybrid" DRAFT_TIMEOUT=100 bash benchmarks/gpu_check.sh
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
part() {  # part NAME TIMEOUT: a heading, and whether the part runs at all
    echo "== $1 ($(date +%T))"
    [ "$2" != 0 ] || { echo "skipped"; return 1; }
}

if part "tests on cuda" "${TESTS_TIMEOUT:-300}"; then
    MULTISPEC_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_device.py tests/engine/test_speculative.py tests/engine/test_reproducible.py 2>&1 \
        | tee "$RESULTS/tests.log" || status=1
fi

if part "forward time per step shape" "${LAYOUT_TIMEOUT:-120}"; then
    for batch in ${LAYOUT_BATCHES-16 64}; do
        timeout "${LAYOUT_TIMEOUT:-120}" "$PY" experiments/layout.py --device cuda --batch "$batch" \
            --repeats "${LAYOUT_REPEATS:-10}" 2>&1 | tee "$RESULTS/layout_$batch.txt" || status=1
    done
fi

if part "ceiling: step cost per draft length" "${CEILING_TIMEOUT:-300}"; then
    timeout "${CEILING_TIMEOUT:-300}" "$PY" benchmarks/bench_ceiling.py --device cuda --seeds 0 ${CEILING_ARGS:-} \
        --cells "${CEILING_CELLS:-4, one at a time;16, one at a time;8x4;8x16;4x64}" 2>&1 \
        | tee "$RESULTS/ceiling.txt" || status=1
fi

if part "speculative decoding benchmark" "${FULL_TIMEOUT:-300}"; then
    # The table, saved cell by cell: what finishes before the timeout is kept and drawn.
    timeout "${FULL_TIMEOUT:-300}" "$PY" benchmarks/bench_spec.py --device cuda --out "$RESULTS/bench_spec.json" \
        ${SPEC_ARGS:-} >"$RESULTS/bench_spec_full.log" 2>&1 \
        || echo "benchmark stopped early (exit $?); keeping finished cells"
    "$PY" benchmarks/bench_spec.py --from-json "$RESULTS/bench_spec.json" --plot "$RESULTS/spec_speedup.png" \
        2>&1 | tee "$RESULTS/bench_spec.md" || status=1
fi

if part "draft-model benchmark" "${DRAFT_TIMEOUT:-300}"; then
    timeout "${DRAFT_TIMEOUT:-300}" "$PY" benchmarks/bench_draft_model.py --device cuda \
        --out "$RESULTS/bench_draft_model.json" ${DRAFT_ARGS:-} 2>&1 | tee "$RESULTS/bench_draft_model.log" \
        || echo "benchmark stopped early (exit $?); finished cells are in bench_draft_model.json"
fi

tar -czf "$RESULTS.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
exit $status
