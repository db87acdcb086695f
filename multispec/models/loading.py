"""Load a checkpoint (config, tensors, tokenizer) from a Hugging Face directory or a GGUF file.

A GGUF file is converted once, with transformers' own GGUF reader (it dequantises and
undoes llama.cpp's q/k row permutation), into an ordinary Hugging Face directory in a
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
from safetensors.torch import load_file, save_file

from multispec.models.config import ARCHITECTURE_OF_MODEL_TYPE, ModelConfig, multimodal, read_json_object
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
        if not multimodal(raw):
            tensors.update(load_file(weights_file))
            continue
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
    """The safetensors files, from the shard index when there is one."""
    index_file = path / "model.safetensors.index.json"
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
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    return files


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


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` as config.json + model.safetensors (float32) + tokenizer files into ``out``.

    Float32 because the dequantised values (scale * q + min, per block) are not exactly
    representable in 16 bits; the loader can still cast when building the network.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config_dict = load_gguf_checkpoint(str(gguf))["config"]
    model_type = config_dict.get("model_type")
    if model_type not in ARCHITECTURE_OF_MODEL_TYPE:
        raise ValueError(f"unsupported architecture {model_type!r}")
    from gguf import GGUFReader

    reader = GGUFReader(gguf)  # for the metadata transformers' reader leaves out or gets wrong
    fields = reader.fields
    head_dim = _gguf_head_dim(fields)
    if head_dim is not None:
        config_dict["head_dim"] = head_dim
    if model_type == "phi3":
        config_dict.update(_gguf_phi3_rope_and_window(reader, config_dict))
    if model_type in ("gemma2", "gemma3_text"):
        config_dict.update(_gguf_gemma_scalars(fields, config_dict))
    if model_type == "gemma3_text":
        config_dict.update(_gguf_gemma3_rope_and_window(fields))
    config = AutoConfig.for_model(**config_dict)
    config.architectures = [ARCHITECTURE_OF_MODEL_TYPE[model_type]]

    # The reader maps GGUF tensor names onto a model's parameter names, so it needs a
    # model; one on the meta device costs no memory.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = set(skeleton.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"tensors missing: {', '.join(missing[:5])}")

    config.save_pretrained(out)
    save_file({name: tensors[name].float().contiguous() for name in sorted(expected)},
              out / "model.safetensors", metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # One tokenizer_config.json that carries the chat template, rather than a separate .jinja file.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _eos_token_from_gguf(fields, out / "tokenizer_config.json")


def _gguf_head_dim(fields: dict) -> int | None:
    """The width of an attention head where the file gives one (llama.cpp's
    ``<arch>.attention.key_length``). transformers' converter does not read it for every
    architecture and falls back to hidden / heads, or to Qwen3's default of 128, which is wrong for
    a model whose heads are of another width."""
    arch = fields.get("general.architecture")
    length = fields.get(f"{arch.contents()}.attention.key_length") if arch is not None else None
    return int(length.contents()) if length is not None else None


def _gguf_phi3_rope_and_window(reader, config: dict) -> dict:
    """What a Phi-3 GGUF says of its rotation and window that transformers' converter drops: the
    rotated share of each head (``phi3.rope.dimension_count``, Phi-4-mini's 96 of 128), LongRoPE's
    factors (llama.cpp keeps them as the tensors ``rope_factors_short``/``rope_factors_long``,
    with ``phi3.rope.scaling.original_context_length`` and ``attn_factor``) and the sliding window
    (0: none). Left out, the model would be converted into another one."""
    fields = reader.fields

    def value(key: str):
        field = fields.get(f"phi3.{key}")
        return field.contents() if field is not None else None

    out = {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotated = value("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:
        out["partial_rotary_factor"] = int(rotated) / head_dim
    if value("attention.sliding_window"):
        out["sliding_window"] = int(value("attention.sliding_window"))
    factors = {t.name: [float(f) for f in t.data] for t in reader.tensors
               if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")}
    if factors:
        if len(factors) != 2 or value("rope.scaling.original_context_length") is None:
            raise ValueError("LongRoPE needs rope_factors_short, rope_factors_long and "
                             "phi3.rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(value("rope.scaling.original_context_length"))
        out["rope_scaling"] = {"rope_type": "longrope", "short_factor": factors["rope_factors_short.weight"],
                               "long_factor": factors["rope_factors_long.weight"],
                               "rope_theta": config.get("rope_theta", 10000.0)}
        if value("rope.scaling.attn_factor") is not None:
            out["rope_scaling"]["attention_factor"] = float(value("rope.scaling.attn_factor"))
    return out


_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The layer count by which llama.cpp knows the 27B models, whose attention scale it derives
from hidden / heads rather than the head width."""


def _gguf_gemma_scalars(fields: dict, config: dict) -> dict:
    """Gemma 2's and 3's soft caps as the file gives them, and their attention scale as llama.cpp
    derives it (the file does not hold it: hidden / heads for the 27B models, else the head
    width), which transformers' converter leaves at its defaults (wrong for the 27B models)."""
    arch = fields["general.architecture"].contents()
    out = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        field = fields.get(f"{arch}.{key}")
        if field is not None:
            out[key] = float(field.contents())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    is_27b = config["num_hidden_layers"] == _GGUF_GEMMA_27B_LAYERS[arch]
    out["query_pre_attn_scalar"] = config["hidden_size"] // heads if is_27b else head_dim
    return out


def _gguf_gemma3_rope_and_window(fields: dict) -> dict:
    """What a Gemma 3 GGUF says of its rotations and windowed layers that transformers' converter
    drops: the full layers' scaling (``gemma3.rope.scaling.type``/``factor``: linear, 8 for the 4B
    model and up), the windowed layers' base (``rope.freq_base_swa``, 10,000 where absent, as
    llama.cpp takes it) and which layers are windowed (``attention.sliding_window_pattern``, a
    period or a flag per layer; every sixth layer full where absent)."""
    def value(key: str):
        field = fields.get(f"gemma3.{key}")
        return field.contents() if field is not None else None

    out = {}
    kind, factor = value("rope.scaling.type"), value("rope.scaling.factor")
    if kind not in (None, "none") and factor is not None and float(factor) != 1.0:
        if kind != "linear":
            raise ValueError(f"gemma3.rope.scaling.type={kind!r}: only linear scaling is supported for Gemma 3")
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    if value("rope.freq_base_swa") is not None:
        out["rope_local_base_freq"] = float(value("rope.freq_base_swa"))
    pattern = value("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    elif pattern is not None:
        out["sliding_window_pattern"] = int(pattern)
    return out


def _eos_token_from_gguf(fields: dict, tokenizer_config: Path) -> None:
    """Name the EOS token in ``tokenizer_config`` as the GGUF's own metadata does.

    The EOS token decides where generation stops, and transformers' GGUF tokenizer has not always
    carried it over (5.17 wrote a Llama GGUF's BOS token as its EOS), so the file's
    ``tokenizer.ggml.eos_token_id`` is authoritative. The BOS stays as transformers reads it: its
    converter drops the BOS that llama.cpp's files name for models that have none (Qwen2)."""
    tokens = fields.get("tokenizer.ggml.tokens")
    field = fields.get("tokenizer.ggml.eos_token_id")
    if field is None or tokens is None:
        return
    token_id = int(field.contents())
    if not 0 <= token_id < len(tokens.data):
        raise ValueError(f"tokenizer.ggml.eos_token_id {token_id} is outside the vocabulary")
    config = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    config["eos_token"] = tokens.contents(token_id)
    if "eos_token_id" in config:
        config["eos_token_id"] = token_id
    tokenizer_config.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
