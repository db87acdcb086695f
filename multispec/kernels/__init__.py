"""Compiled CPU kernels, built on first use with the machine's C++ compiler and cached.

Operators for the decode step, in one library: the attention over the two-level cache
(``decode_attention.cpp``; the generic fused attention pays a fixed cost per (sample, kv head)
matrix and per call that dominates small decode steps on a CPU), the whole layer stack around it
(``decode_layers.cpp``; the thirty small operators a layer that the Python path dispatches one by
one; the same file holds a draft head's layer for one depth of its tree), the step's target
distribution from its logits and the draws from it (``sampling.cpp``; four passes over a [rows,
vocabulary] matrix and some fifteen small operators in the Python path) and the matrix products of
a step's rows on AMX tiles or AVX512-BF16 vectors, or in float32 on AVX2 vectors where the CPU has
no AVX-512 (``stream_gemm.cpp``; bound by reading the weights, which the CPU library's product does
at about half the machine's bandwidth). Their parallel loops share one work split (``common.h``,
tested through ``schedule.cpp``): each thread starts on its own share and a thread that runs out
takes items from another's. They are compiled once per machine, torch version and source (about 20
seconds on a 2-core CPU) into the cache directory (``MULTISPEC_CACHE``, default
``~/.cache/multispec``) with ``-O3 -march=native``. Where they cannot be built (no compiler, no
ninja) the engine keeps its portable path and says so once; ``MULTISPEC_KERNELS=0`` turns them off.

A second, smaller library is a Python module, not operators: the suffix drafters' store
(``suffix_store.cpp``: texts, n-gram index, lookup and vote trie, kept across steps), built the
same way on first use (a few seconds) and turned off by the same variable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

log = logging.getLogger("multispec")

SOURCES = [Path(__file__).with_name(name)
           for name in ("decode_attention.cpp", "decode_layers.cpp", "sampling.cpp", "stream_gemm.cpp", "schedule.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("common.h", "amx_attention.h", "decode_attention.h")]
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
         "-falign-loops=32", "-fopenmp"]
"""Compiler flags. GCC vectorises for 256-bit registers on AVX-512 CPUs unless told otherwise; the
kernels' loops (exponentials, sums over a row) ran 15-25% faster with the full width here (the
softmax of 128 rows of 49k logits, 6.0-6.4 -> 4.4-5.5 ms); without AVX-512 the flag does nothing.
``-fno-trapping-math``: without AVX-512's masks GCC would not vectorise a loop with a conditional
around a floating-point operation that might trap (silu, the softmaxes' exponentials ran one float
at a time on AVX2); nothing here reads floating-point exception flags, and no result changes.
``-falign-loops=32``: every loop starts on a 32-byte boundary. The float32 product's inner loop (a
few dozen instructions) ran 16% slower on a 2-core Zen 2 once an edit to the code around it had
moved it by 32 bytes (the same instructions; ``experiments/stream_builds.py``); aligned, such
shifts no longer move it. Placement at a larger scale still can: docs/results.md, "The float32
products of a few rows"."""

_lock = threading.Lock()
_state: dict[str, object] = {}
_handles: dict[str, object] = {}


def enabled() -> bool:
    """Whether the kernels may be used (``MULTISPEC_KERNELS=0`` turns them off)."""
    return os.environ.get("MULTISPEC_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def build_key(paths: list[Path] | None = None, flags: list[str] | None = None) -> str:
    """What a compiled library depends on (sources, flags, torch, the machine), hashed; by default
    the operators' library's."""
    from multispec.engine.costs import machine

    source = b"".join(path.read_bytes() for path in (SOURCES + HEADERS if paths is None else paths))
    return hashlib.sha256(source + " ".join(FLAGS if flags is None else flags).encode() + torch.__version__.encode()
                          + platform.machine().encode() + machine().encode()).hexdigest()[:16]


def _build_dir(name: str | None = None) -> Path:
    from multispec.models.loading import default_cache_dir

    return default_cache_dir() / "kernels" / (name or build_key())


def _warn_unbuilt(what: str, error: Exception, instead: str, stacklevel: int) -> None:
    """The one warning that a compiled library could not be built, with the error's last line
    (``stacklevel`` as the caller would pass it)."""
    text = str(error).strip()
    warnings.warn(f"multispec: the compiled {what} could not be built ({type(error).__name__}: "
                  f"{text.splitlines()[-1] if text else ''}); {instead}", RuntimeWarning, stacklevel=stacklevel + 1)


def decode_attention():
    """``torch.ops.multispec.decode_attention``, built or loaded on the first call; None where the
    kernels are off or cannot be built (one warning says why)."""
    return _op("decode_attention")


def decode_layers():
    """``torch.ops.multispec.decode_layers`` (see ``decode_layers.cpp``), or None as above."""
    return _op("decode_layers")


def head_layer():
    """``torch.ops.multispec.head_layer`` (a draft head's layer for one depth, see
    ``decode_layers.cpp``), or None as above."""
    return _op("head_layer")


def softmax_rows():
    """``torch.ops.multispec.softmax_rows`` (see ``sampling.cpp``), or None as above."""
    return _op("softmax_rows")


def softmax_truncated():
    """``torch.ops.multispec.softmax_truncated`` (``softmax_rows`` with each row's top-k, top-p and
    min-p, see ``sampling.cpp``), or None as above."""
    return _op("softmax_truncated")


def sample_rows():
    """``torch.ops.multispec.sample_rows`` (see ``sampling.cpp``), or None as above."""
    return _op("sample_rows")


def softmax_draw():
    """``torch.ops.multispec.softmax_draw`` (``softmax_rows`` then ``sample_rows`` in one pass, see
    ``sampling.cpp``), or None as above."""
    return _op("softmax_draw")


def top_rows():
    """``torch.ops.multispec.top_rows`` (the k likeliest tokens of some rows, see ``sampling.cpp``),
    or None as above."""
    return _op("top_rows")


def mask_rows():
    """``torch.ops.multispec.mask_rows`` (a grammar's bitmask on some rows of the logits, in place,
    see ``sampling.cpp``), or None as above."""
    return _op("mask_rows")


def token_logprobs():
    """``torch.ops.multispec.token_logprobs`` (each row's following token's log-probability and
    rank, and the k likeliest, see ``sampling.cpp``), or None as above."""
    return _op("token_logprobs")


def stream_available() -> bool:
    """Whether bf16 products can stream their weights through ``stream_linear`` here (see
    ``stream_kind``)."""
    return stream_kind() > 0


def stream_kind() -> int:
    """How ``stream_linear`` multiplies here: 2 on AMX tiles (the CPU has them, Linux grants them
    and ``MULTISPEC_AMX`` is not "0"), 1 on AVX512-BF16 vectors (the kernels were built for a CPU
    that has them), both bf16; 3 float32 on AVX2 vectors (a CPU with AVX2 and FMA but no AVX-512);
    0 not at all (none of these, the kernels are off, or ``MULTISPEC_STREAM`` is "0": the CPU
    library's product). The variables are read at every call, so a comparison can switch."""
    return int(torch.ops.multispec.stream_kind()) if _op("stream_kind") is not None else 0


def stream_dtype() -> torch.dtype | None:
    """The dtype whose weights ``stream_linear`` streams here (see ``stream_kind``), or None."""
    return {1: torch.bfloat16, 2: torch.bfloat16, 3: torch.float32}.get(stream_kind())


STORE_SOURCE = Path(__file__).with_name("suffix_store.cpp")
STORE_FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
"""The suffix store's flags: no fused multiply-adds, so its vote weights round as Python's do."""


def suffix_store():
    """The compiled suffix drafters' store (``suffix_store.cpp``, a Python module), built or loaded
    on the first call; None where the kernels are off or it cannot be built (one warning says
    why, and the drafters keep their Python path)."""
    if not enabled():
        return None
    module = _handles.get("suffix_store")
    if module is not None or "store built" in _state:
        return module
    with _lock:
        if "store built" not in _state:
            try:
                _handles["suffix_store"] = _load_store()
            except Exception as error:  # noqa: BLE001 - any build failure means: use the Python path
                _warn_unbuilt("suffix store", error, "the suffix drafters use their Python path", 3)
            _state["store built"] = True
    return _handles.get("suffix_store")


def _load_store():
    import importlib.util

    from torch.utils import cpp_extension

    build = _build_dir("store-" + build_key([STORE_SOURCE], STORE_FLAGS))
    build.mkdir(parents=True, exist_ok=True)
    name = "multispec_suffix_store"
    library = next(build.glob(f"{name}*.so"), None)
    if library is None:
        log.info("compiling the suffix drafters' store once for this machine (a few seconds)")
        return cpp_extension.load(name=name, sources=[str(STORE_SOURCE)], extra_cflags=STORE_FLAGS,
                                  build_directory=str(build), is_python_module=True, verbose=False)
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _op(name: str):
    if not enabled():
        return None
    op = _handles.get(name)  # a decode step asks for several ops; the lookups add up
    if op is not None:
        return op
    with _lock:
        if "built" not in _state:
            built = False
            try:
                _load()
                built = True
            except Exception as error:  # noqa: BLE001 - any build failure means: use the portable path
                _warn_unbuilt("CPU kernels", error, "decoding uses the portable path, which is slower on small batches",
                              4)
            _state["built"] = built
        if not _state["built"]:
            return None
        op = _handles[name] = getattr(torch.ops.multispec, name)
        return op


def _load() -> None:
    if hasattr(torch.ops, "multispec") and hasattr(torch.ops.multispec, "decode_layers"):
        return
    from torch.utils import cpp_extension

    build = _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    library = build / "multispec_kernels.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        log.info("compiling the CPU decode kernels once for this machine (about 15 seconds on a 2-core CPU)")
        cpp_extension.load(name="multispec_kernels", sources=[str(path) for path in SOURCES], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                           verbose=False)
