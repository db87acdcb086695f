"""Load a checkpoint (config, tensors, tokenizer) from a Hugging Face directory or a GGUF file.

A GGUF file is converted once (``gguf_files``) into an ordinary Hugging Face directory in a
cache; every later load reads that directory. transformers is imported only for the
conversion, so a cached load costs little more than importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from multispec.models.config import ModelConfig, multimodal, read_json_object
from multispec.models.gguf_files import convert_gguf as _convert_gguf
from multispec.models.tokenizer import Tokenizer

_GGUF_MAGIC = b"GGUF"
CONVERSION = 2
"""Version of the GGUF conversion, part of the cache key (2: the EOS token taken from the GGUF's own
metadata)."""


@dataclass
class Checkpoint:
    """A loaded model: tensors use the Hugging Face Llama names, as stored (no dtype change).

    ``lm_head.weight`` is absent when the embeddings are tied.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path


def load_checkpoint(path: str | Path, cache_dir: str | Path | None = None) -> Checkpoint:
    """Load a Hugging Face checkpoint directory or a ``.gguf`` file.

    ``cache_dir`` is where GGUF conversions live (default ``$MULTISPEC_CACHE`` or
    ``~/.cache/multispec``); ``Checkpoint.path`` is the directory actually read.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").is_file():  # a GGUF repository's snapshot, say
            if len(ggufs) > 1:
                raise ValueError(f"{path} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}) and no "
                                 f"config.json: give the one to load")
            return _load_hf_dir(_converted_gguf(ggufs[0], _cache_root(cache_dir)))
        return _load_hf_dir(path)
    if path.is_file():
        if not is_gguf(path):
            raise ValueError(f"{path} is neither a checkpoint directory nor a GGUF file")
        return _load_hf_dir(_converted_gguf(path, _cache_root(cache_dir)))
    raise ValueError(f"checkpoint not found: {path}")


GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""The sampling defaults a checkpoint's ``generation_config.json`` may give, and the
``SamplingParams`` field each sets: the ones vLLM takes from it."""


def load_tokenizer(name_or_path: str | Path, config: ModelConfig) -> Tokenizer:
    """A tokenizer other than a checkpoint's own (``LLM(tokenizer=)``, as vLLM's): a directory
    holding ``tokenizer.json`` or a Hub repository id in the local cache. Every id it can produce
    must name a row of the model's vocabulary (``config.vocab_size``)."""
    from multispec.models.registry import resolve_model

    name = str(name_or_path)
    try:
        path = resolve_model(name)
        if not path.is_dir():
            raise ValueError(f"{path} is not a directory holding tokenizer.json")
        tokenizer = Tokenizer.from_dir(path)
    except ValueError as error:
        raise ValueError(f"tokenizer={name!r}: {error}") from None
    largest = max(tokenizer.vocab().values())
    if largest >= config.vocab_size:
        raise ValueError(f"tokenizer={name!r}: its ids reach {largest}, past the model's vocabulary of "
                         f"{config.vocab_size} tokens")
    return tokenizer


def generation_defaults(directory: str | Path) -> dict:
    """The sampling defaults in ``directory``'s ``generation_config.json`` (``{}`` where there is
    none), as ``SamplingParams`` fields; a malformed file or value is a ValueError naming it."""
    path = Path(directory).expanduser() / "generation_config.json"
    config = read_json_object(path)
    defaults = {field: config[key] for key, field in GENERATION_FIELDS.items() if config.get(key) is not None}
    from multispec.params import SamplingParams

    try:
        SamplingParams(**defaults)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return defaults


def default_cache_dir() -> Path:
    return Path(os.environ.get("MULTISPEC_CACHE") or Path.home() / ".cache" / "multispec")


def weights_key(path: str | Path) -> str:
    """Names a checkpoint's weights as they are on disk (path, sizes, modification times), so that
    what was measured for them (the step costs) is measured again when they change."""
    path = Path(path).expanduser().resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return f"{path}|" + "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def _cache_root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _load_hf_dir(path: Path) -> Checkpoint:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json; not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON in {config_file}: {exc}") from None
    config = ModelConfig.from_hf_dict(raw)

    tensors: dict[str, torch.Tensor] = {}
    for weights_file in _weight_files(path):
        if weights_file.suffix != ".safetensors":
            stored = _torch_weights(weights_file)
            tensors.update({_language_model_name(key): tensor for key, tensor in stored.items()
                            if _language_model_name(key) is not None} if multimodal(raw) else stored)
        elif not multimodal(raw):
            tensors.update(load_file(weights_file))
        else:
            with safe_open(weights_file, framework="pt") as handle:  # the language model's tensors only
                for key in handle.keys():
                    name = _language_model_name(key)
                    if name is not None:
                        tensors[name] = handle.get_tensor(key)
    # Old checkpoints store RoPE buffers, and some store the tied head twice; neither is a parameter.
    tensors = {name: t for name, t in tensors.items() if not name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return Checkpoint(config=config, tensors=tensors, tokenizer=Tokenizer.from_dir(path), path=path)


def _language_model_name(name: str) -> str | None:
    """A multimodal Gemma 3 tensor's name in its language model (``language_model.model.*`` as
    its checkpoints store it, or ``model.language_model.*`` as transformers v5 names it), or None
    for the vision tower's and the projector's."""
    for prefix, to in (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files, from the shard index when there is one; where there are none, the
    PyTorch files of older checkpoints (``pytorch_model.bin``, or the shards its index lists)."""
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index_file = path / index_name
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"malformed shard index {index_file}: {exc}") from None
            files = [path / name for name in sorted(set(weight_map.values()))]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise ValueError(f"{index_file} lists missing shards: {', '.join(absent)}")
            return files
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise ValueError(f"{path} has no weights (*.safetensors, or pytorch_model.bin)")


def _torch_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PyTorch weights file, mapped rather than read where its format allows.
    Only tensors are unpickled (``weights_only``): a file that holds code is refused."""
    import pickle

    try:
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be mapped
            return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise ValueError(f"cannot read {file} as PyTorch weights: {error}") from None


def _converted_gguf(gguf: Path, cache_root: Path) -> Path:
    """The cached Hugging Face directory for ``gguf``, converting it first if needed.

    The key covers the file's resolved path, size and mtime, so an edited or replaced
    file is converted again. The conversion is written to a temporary directory and
    renamed into place, so a crash or a concurrent load never leaves a half-written entry.
    """
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION}".encode()).hexdigest()[:16]
    root = cache_root / "gguf"
    target = root / f"{gguf.stem}-{key}"
    if target.is_dir():
        return target

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    try:
        try:
            _convert_gguf(gguf, tmp)
        except Exception as exc:  # the GGUF reader fails in many ways on a damaged file
            raise ValueError(f"cannot convert GGUF {gguf}: {exc}") from exc
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf)}), encoding="utf-8")
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale_conversions(root, gguf, keep=target)
    return target


def _remove_stale_conversions(root: Path, gguf: Path, keep: Path) -> None:
    """Delete earlier conversions of the same file: each holds a full float32 copy of the model."""
    for entry in root.iterdir():
        source = entry / "source.json"
        if entry == keep or not entry.name.startswith(f"{gguf.stem}-") or not source.is_file():
            continue
        if json.loads(source.read_text(encoding="utf-8")).get("gguf") == str(gguf):
            shutil.rmtree(entry, ignore_errors=True)
