"""Compiled CPU kernels, built on first use with the machine's C++ compiler and cached.

The decode step's attention over the two-level cache (``decode_attention.cpp``) is the one kernel:
the generic fused attention pays a fixed cost per (sample, kv head) matrix and per call that
dominates small decode steps on a CPU. It is compiled once per machine, torch version and source
(about 10 seconds on a 2-core CPU) into the cache directory (``MULTISPEC_CACHE``, default
``~/.cache/multispec``) with ``-O3 -march=native``. Where it cannot be built (no compiler, no
ninja) the engine keeps its portable path and says so once; ``MULTISPEC_KERNELS=0`` turns the
kernel off.
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

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    """Whether the kernels may be used (``MULTISPEC_KERNELS=0`` turns them off)."""
    return os.environ.get("MULTISPEC_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _build_dir() -> Path:
    from multispec.engine.costs import machine
    from multispec.models.loading import default_cache_dir

    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + torch.__version__.encode()
                         + platform.machine().encode() + machine().encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / key


def decode_attention():
    """``torch.ops.multispec.decode_attention``, built or loaded on the first call; None where the
    kernel is off or cannot be built (one warning says why)."""
    if not enabled():
        return None
    with _lock:
        if "op" in _state:
            return _state["op"]
        op = None
        try:
            op = _load()
        except Exception as error:  # noqa: BLE001 - any build failure means: use the portable path
            warnings.warn(f"multispec: the compiled CPU attention could not be built ({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}); decoding "
                          "uses the portable path, which is slower on small batches", RuntimeWarning, stacklevel=3)
        _state["op"] = op
        return op


def _load():
    if hasattr(torch.ops, "multispec") and hasattr(torch.ops.multispec, "decode_attention"):
        return torch.ops.multispec.decode_attention
    from torch.utils import cpp_extension

    build = _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    library = build / "multispec_kernels.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        log.info("compiling the CPU attention kernel once for this machine (about 10 seconds on a 2-core CPU)")
        cpp_extension.load(name="multispec_kernels", sources=[str(SOURCE)], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                           verbose=False)
    return torch.ops.multispec.decode_attention
