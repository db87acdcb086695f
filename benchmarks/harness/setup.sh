#!/usr/bin/env bash
# Set up EleutherAI's lm-evaluation-harness for benchmarks/harness/run.py, in its own virtual
# environment (benchmarks/harness/env, git-ignored; never a dependency of the project): the CPU
# build of torch first (pinned, as for the project: an unpinned torch pulls a multi-GB CUDA
# build), then lm-eval with its API client ("api") and transformers backend ("hf").
#
# Idempotent: an environment that already imports lm_eval is left as it is.
#   bash benchmarks/harness/setup.sh
# Environment variables:
#   PYTHON        the interpreter the environment is built from (default: python3)
#   LM_EVAL_SPEC  what pip installs (default: lm-eval[api,hf]==0.4.13, the version tested)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENV="$HERE/env"
PYTHON="${PYTHON:-python3}"
LM_EVAL_SPEC="${LM_EVAL_SPEC:-lm-eval[api,hf]==0.4.13}"
CHECK='import lm_eval, tenacity, transformers; from importlib.metadata import version; print(version("lm_eval"))'

if [ -x "$ENV/bin/python" ] && have="$("$ENV/bin/python" -c "$CHECK" 2>/dev/null)"; then
    echo "[setup] lm-eval $have already in $ENV"
    exit 0
fi
[ -x "$ENV/bin/python" ] || "$PYTHON" -m venv "$ENV"
"$ENV/bin/python" -m pip install --quiet --upgrade pip
"$ENV/bin/python" -m pip install --quiet torch==2.13.0
"$ENV/bin/python" -m pip install --quiet "$LM_EVAL_SPEC"
echo "[setup] lm-eval $("$ENV/bin/python" -c "$CHECK") in $ENV"
