#!/usr/bin/env bash
# The checks that need a CPU with AMX tiles (an Intel Xeon of the Sapphire Rapids generation or
# later), in one run: about 45 minutes on 2 cores with the defaults; the settings below narrow it.
#   1. the tests that run only on tiles (the attention's tile passes, the tile products and the
#      fused gate/up product; elsewhere they skip), and the bf16 tests;
#   2. fresh step prices for this machine and model (`multispec calibrate`: what the default draft
#      budget weighs drafts against);
#   3. the roofline (benchmarks/roofline.py): each step shape's floor against the engine's step,
#      and what perfect drafts could gain there;
#   4. the default speculation against plain (benchmarks/bench_spec.py, consensus-auto): 8 x 16 in
#      one call, one request of 4 and one of 16 at a time, median of 3;
#   5. the draft head and the hybrid against plain with one request of 4 and of 16
#      (benchmarks/bench_draft_model.py), median of 3.
# Time nothing else on the machine meanwhile: every benchmark ends with the share of time its
# threads waited for a core, and above 10% its figures are the machine's, not the engine's.
# Everything lands in $RESULTS (default results/amx), and in one archive $RESULTS.tar.gz. Run from
# the repository root with the project's dependencies and the default model installed (see the
# README):
#   bash benchmarks/amx_check.sh
# Each part's time limit (seconds) and arguments can be changed (a timeout of 0 skips the part):
#   TESTS_TIMEOUT=300 CALIBRATE_TIMEOUT=300 ROOFLINE_TIMEOUT=600 SPEC_TIMEOUT=1500 DRAFT_TIMEOUT=1500
#   ROOFLINE_ARGS="--samples 4,16,128 --lengths 0,1 --repeats 3"
#   SPEC_ARGS="--cells 1,4,5 --rows consensus-auto --depth 6 --nodes 6 --runs 3"
#   DRAFT_ARGS="--cells 0,1 --rows consensus,model-auto,hybrid --temperatures 0.7 --runs 3"
# AMX_CHECK_ANYWAY=1 runs it on a CPU without tiles (to try the script; the tile tests then skip).
set -uo pipefail
RESULTS=${RESULTS:-results/amx}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MULTISPEC_NO_PROGRESS=1
"$PY" - <<'EOF' 2>&1 | tee "$RESULTS/machine.txt"
import os, platform, torch
from multispec import kernels
kind = {2: "AMX tiles", 1: "AVX512-BF16 vectors", 3: "AVX2 (float32)"}.get(kernels.stream_kind(), "none")
model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"{model}; {os.cpu_count()} logical CPUs; torch {torch.__version__} ({torch.get_num_threads()} threads); "
      f"{platform.python_version()}; products on {kind}")
EOF
if ! grep -qw amx_tile /proc/cpuinfo && [ "${AMX_CHECK_ANYWAY:-0}" != 1 ]; then
    echo "amx_check: this CPU has no AMX tiles (no amx_tile in /proc/cpuinfo); AMX_CHECK_ANYWAY=1 runs it anyway" >&2
    exit 1
fi

status=0
part() {  # part NAME TIMEOUT: a heading, and whether the part runs at all
    echo "== $1 ($(date +%T))"
    [ "$2" != 0 ] || { echo "skipped"; return 1; }
}

if part "tests on tiles" "${TESTS_TIMEOUT:-300}"; then
    timeout "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/engine/test_attention.py \
        tests/models/test_stream_gemm.py tests/engine/test_bf16.py 2>&1 | tee "$RESULTS/tests.log" || status=1
fi

if part "step prices" "${CALIBRATE_TIMEOUT:-300}"; then
    timeout "${CALIBRATE_TIMEOUT:-300}" "$PY" -m multispec calibrate 2>&1 | tee "$RESULTS/calibrate.log" || status=1
fi

if part "roofline" "${ROOFLINE_TIMEOUT:-600}"; then
    timeout "${ROOFLINE_TIMEOUT:-600}" "$PY" benchmarks/roofline.py \
        ${ROOFLINE_ARGS:---samples 4,16,128 --lengths 0,1 --repeats 3} 2>&1 | tee "$RESULTS/roofline.md" || status=1
fi

if part "default speculation against plain" "${SPEC_TIMEOUT:-1500}"; then
    timeout "${SPEC_TIMEOUT:-1500}" "$PY" benchmarks/bench_spec.py --out "$RESULTS/bench_spec.json" \
        ${SPEC_ARGS:---cells 1,4,5 --rows consensus-auto --depth 6 --nodes 6 --runs 3} 2>&1 \
        | tee "$RESULTS/bench_spec.log" || status=1
fi

if part "draft head and hybrid against plain" "${DRAFT_TIMEOUT:-1500}"; then
    timeout "${DRAFT_TIMEOUT:-1500}" "$PY" benchmarks/bench_draft_model.py --out "$RESULTS/bench_draft_model.json" \
        ${DRAFT_ARGS:---cells 0,1 --rows consensus,model-auto,hybrid --temperatures 0.7 --runs 3} 2>&1 \
        | tee "$RESULTS/bench_draft_model.log" || status=1
fi

tar -czf "$RESULTS.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
echo "results in $RESULTS and $RESULTS.tar.gz"
exit $status
