"""Reading llama.cpp's GGUF files into Hugging Face checkpoint directories.

transformers' own GGUF reader dequantises the tensors and undoes llama.cpp's q/k row permutation
for the architectures it knows; what it leaves out or gets wrong (a Phi-3 model's rotation and
window, Gemma's caps, scales and rotations, the EOS token) is read from the metadata here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from multispec.models.config import ARCHITECTURE_OF_MODEL_TYPE


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` as config.json + model.safetensors (float32) + tokenizer files into ``out``.

    Float32 because the dequantised values (scale * q + min, per block) are not exactly
    representable in 16 bits; the loader can still cast when building the network.
    """
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    reader = GGUFReader(gguf)  # for the metadata transformers' reader leaves out or gets wrong
    fields = reader.fields
    arch = _field(fields, "general.architecture")
    own = arch in OWN_ARCHITECTURES
    if not own and arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    config_dict = _own_config(reader, arch) if own else _decimal(load_gguf_checkpoint(str(gguf))["config"])
    model_type = config_dict.get("model_type")
    if model_type not in ARCHITECTURE_OF_MODEL_TYPE:
        raise ValueError(f"unsupported architecture {model_type!r}")
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
    if own:
        tensors = _own_tensors(reader, arch, skeleton, config)
    else:
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = set(skeleton.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"tensors missing: {', '.join(missing[:5])}")
    shapes = skeleton.state_dict()
    for name in sorted(expected):
        if tensors[name].shape != shapes[name].shape:
            raise ValueError(f"{name} is {tuple(tensors[name].shape)} in the file where its config makes it "
                             f"{tuple(shapes[name].shape)}")

    config.save_pretrained(out)
    save_file({name: tensors[name].float().contiguous() for name in sorted(expected)},
              out / "model.safetensors", metadata={"format": "pt"})
    # AutoTokenizer picks the class by the model, through transformers' GGUF config reader; the
    # tokenizer of a file that reader does not know is built from its metadata alone.
    tokenizer_class = PreTrainedTokenizerFast if own else AutoTokenizer
    tokenizer = tokenizer_class.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # One tokenizer_config.json that carries the chat template, rather than a separate .jinja file.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _eos_token_from_gguf(fields, out / "tokenizer_config.json")


OWN_ARCHITECTURES = {"gemma": "GEMMA", "smollm3": "SMOLLM3", "granite": "GRANITE", "olmo2": "OLMO2"}
"""The llama.cpp architectures read here rather than by transformers' GGUF reader, which does not
know them, and their ``gguf.MODEL_ARCH`` names. Each is written by llama.cpp's converter as the
checkpoint's tensors under llama.cpp's names, with these changes undone on reading: SmolLM3 and
Granite (converted as Llama) have q's and k's rows (weights and biases) reordered per head into
interleaved rotary pairs; Gemma's norms are stored as 1 + weight."""

_PERMUTED = ("smollm3", "granite")
_GGUF_CONFIG_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                     "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                     "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                     "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
                     "vocab_size": "vocab_size"}
_GGUF_REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
_GGUF_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}
_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                   "logit_scale": "logits_scaling", "attention.scale": "attention_multiplier"}


def _field(fields: dict, key: str):
    """The value of ``key`` (None where the file lacks it), its floats as ``_decimal`` reads them."""
    field = fields.get(key)
    return _decimal(field.contents()) if field is not None else None


def _decimal(value):
    """A GGUF stores floats in 32 bits: each float in ``value`` (a number, or one inside a list or
    dict) read back as the shortest decimal that rounds to those bits (1e-06, not 9.99999997e-07),
    the value the checkpoint's config had."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    if isinstance(value, list):
        return [_decimal(item) for item in value]
    if isinstance(value, dict):
        return {key: _decimal(item) for key, item in value.items()}
    return value


def _own_config(reader, arch: str) -> dict:
    """The Hugging Face config of a GGUF of one of ``OWN_ARCHITECTURES``, from the keys llama.cpp's
    converter writes (``<arch>.block_count`` and so on; the head width is read with the others'
    below). What the file leaves out is what llama.cpp assumes: SmolLM3's unrotated layers every
    fourth, Granite's attention scale the head width's inverse square root where it holds none."""
    fields = reader.fields

    def value(key: str):
        return _field(fields, f"{arch}.{key}")

    missing = [f"{arch}.{key}" for key in _GGUF_REQUIRED if value(key) is None]
    if missing:
        raise ValueError(f"the file lacks {', '.join(missing)}")
    config = {"model_type": arch}
    config.update({name: value(key) for key, name in _GGUF_CONFIG_KEYS.items() if value(key) is not None})
    tokens = fields.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and tokens is not None:
        config["vocab_size"] = len(tokens.data)
    config.update({name: int(_field(fields, f"tokenizer.ggml.{key}")) for key, name in _GGUF_TOKEN_IDS.items()
                   if _field(fields, f"tokenizer.ggml.{key}") is not None})
    stored = {t.name for t in reader.tensors}
    config["attention_bias"] = "blk.0.attn_q.bias" in stored
    config["mlp_bias"] = "blk.0.ffn_up.bias" in stored
    config.setdefault("pad_token_id", None)  # not the architecture's default, which may lie outside the vocabulary
    config["tie_word_embeddings"] = "output.weight" not in stored
    if "rope_freqs.weight" in stored:
        raise ValueError("rope_freqs.weight (Llama 3's scaled rotation, as factors) is not supported for "
                         f"{arch!r} files")
    kind, factor = value("rope.scaling.type"), value("rope.scaling.factor")
    if kind == "linear" and factor is not None:
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn" and factor is not None:
        config["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor)}
        if value("rope.scaling.original_context_length") is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                value("rope.scaling.original_context_length"))
        if value("rope.scaling.attn_factor") is not None:
            config["rope_scaling"]["attention_factor"] = float(value("rope.scaling.attn_factor"))
    elif kind not in (None, "none"):
        raise ValueError(f"{arch}.rope.scaling.type={kind!r}: only linear and yarn scaling are read from "
                         f"{arch!r} files")
    if arch == "olmo2" and value("attention.sliding_window"):
        raise ValueError("an olmo2 file with attention.sliding_window holds OLMo 3, which is not supported")
    if arch == "smollm3":
        config["no_rope_layer_interval"] = 4  # llama.cpp's n_no_rope_layer_step: the file holds none
    if arch == "granite":
        config.update({name: float(value(key)) for key, name in _GRANITE_SCALES.items() if value(key)})
        if "attention_multiplier" not in config:
            head_dim = _field(fields, f"{arch}.rope.dimension_count") or config["hidden_size"] // config[
                "num_attention_heads"]
            config["attention_multiplier"] = float(head_dim) ** -0.5
    return config


def _own_tensors(reader, arch: str, skeleton, config) -> dict[str, torch.Tensor]:
    """The tensors of a GGUF of one of ``OWN_ARCHITECTURES`` under the names of ``skeleton``'s
    parameters, dequantised, with llama.cpp's changes undone (see ``OWN_ARCHITECTURES``); the
    names are gguf-py's own map of each architecture's tensors."""
    import gguf

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, OWN_ARCHITECTURES[arch]), config.num_hidden_layers)
    hf_names = {}
    for name in skeleton.state_dict():
        stem, kind = name.rsplit(".", 1)
        mapped = names.get_name(stem)
        if mapped is not None:
            hf_names[f"{mapped}.{kind}"] = name
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    unread = sorted(t.name for t in reader.tensors if t.name not in hf_names)
    if unread:
        raise ValueError(f"tensors the {arch!r} model has no place for: {', '.join(unread[:5])}")
    tensors = {}
    for tensor in reader.tensors:
        name = hf_names[tensor.name]
        weights = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
        projection = name.split(".")[-2]
        if arch in _PERMUTED and projection in heads:
            weights = _pairs_to_halves(weights, heads[projection])
        if arch == "gemma" and name.endswith("norm.weight"):
            weights = weights - 1
        tensors[name] = weights
    return tensors


def _pairs_to_halves(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's order of q's or k's rows: within each head the pairs x0 y0 x1 y1 ... back to
    the rotary halves x0 x1 ... | y0 y1 ... that the checkpoint (rotating by halves) has."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


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
