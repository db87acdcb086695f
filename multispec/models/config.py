"""Model hyper-parameters read from a Hugging Face ``config.json``.

multispec runs its own Llama-family network, so this is the single place where the
many spellings found in real checkpoints (old ``rope_scaling`` vs newer
``rope_parameters``, missing optional keys, per-architecture defaults) are turned
into one plain, fully resolved description.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Values Hugging Face's config classes fall back to when config.json omits a key.
# They differ per architecture, so a checkpoint that relies on them means the same
# thing here as it does in transformers.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {
        "max_position_embeddings": 2048,
        "num_key_value_heads": None,  # None: same as num_attention_heads
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "MistralForCausalLM": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen2ForCausalLM": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "Qwen3ForCausalLM": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,  # not hidden_size / heads: Qwen3's heads are wider than that
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "GraniteForCausalLM": {
        "max_position_embeddings": 2048,
        "num_key_value_heads": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Olmo2ForCausalLM": {
        "max_position_embeddings": 2048,
        "num_key_value_heads": None,
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": 50279,
    },
    "SmolLM3ForCausalLM": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": True,
        "rope_theta": 2000000.0,
        "no_rope_layer_interval": 4,
    },
    "GemmaForCausalLM": {
        "max_position_embeddings": 8192,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
    },
    "Gemma2ForCausalLM": {
        "max_position_embeddings": 8192,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "Gemma3ForCausalLM": {
        "max_position_embeddings": 131072,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
    "Phi3ForCausalLM": {
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,  # what LongRoPE's short factors were trained for
        "num_key_value_heads": None,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 32000,
    },
}
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                              "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                              "smollm3": "SmolLM3ForCausalLM",
                              "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM"}
_GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
_SANDWICH = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""Architectures with Gemma 2's norms around each block (and its attention scale and soft caps)."""
_BIASED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
           *_GEMMA)
"""Architectures whose ``attention_bias`` puts a bias on q, k, v and o (Qwen2's is always on, without o's)."""
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Scaled RoPE types that are defined relative to the pre-training context length.
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the network needs to know about a Llama-family checkpoint.

    ``rope_scaling`` is ``None`` for plain RoPE; otherwise it holds ``rope_type`` plus
    that type's parameters (never ``rope_theta``, which has its own field).
    ``attention_bias`` means q/k/v projections carry a bias (always for Qwen2; for the others that
    read it it also puts a bias on o_proj, see the checkpoint's tensors).
    ``qk_norm``: each head of q and k is RMS-normalised (its own weight per layer) before the
    rotation (Qwen3; Gemma 3, whose norms all scale by 1 + their weight). ``sliding_window``: the
    number of positions a query sees (itself and those before it) in the layers that use a sliding
    window (Mistral's default, Qwen's ``use_sliding_window``, Phi-3's, Gemma 2's and 3's), None
    where every layer attends to the whole sequence; ``window_layers``: per layer, whether it is
    one of those (empty: every layer is, where there is a window); ``local_rope_theta``: those
    layers rotate q and k by plain RoPE of this base, not by ``rope_theta`` and ``rope_scaling``
    (Gemma 3's local layers); None: every layer rotates alike. ``partial_rotary_factor``: the
    share of each head's dimensions that is rotated (the first ``rotary_dim``; Phi-4-mini's
    0.75), the rest passes unrotated.
    ``rope_layers``: per layer, whether it rotates q and k (SmolLM3 leaves every fourth layer
    unrotated, "NoPE"); empty where every layer does.

    Gemma: ``hidden_act`` (the MLP's gate activation: Gemma's tanh-approximated GELU),
    ``gemma_norms`` (each RMS norm scales by 1 + its weight, in float32, and the embeddings by sqrt(hidden_size)),
    ``sandwich_norms`` (Gemma 2 and 3: each block's output normalised too, before the residual add, and
    the MLP's input by its own norm), ``query_pre_attn_scalar`` (attention scores scaled by its
    inverse square root, not the head width's), ``attn_logit_softcapping`` and
    ``final_logit_softcapping`` (scores and logits passed through ``cap * tanh(x / cap)``).

    OLMo 2: ``post_norms`` (no norm before attention or MLP: each block's output is normalised,
    before the residual add, and the norms scale in float32), ``qk_norm_whole`` (q and k each
    RMS-normalised across all their heads at once, before the rotation).

    Granite: ``embedding_multiplier`` (the embeddings scaled by it), ``residual_multiplier`` (each
    block's output, before the residual add), ``attention_multiplier`` (the scores' scale, in place
    of the head width's inverse square root), ``logits_scaling`` (the logits divided by it).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    qk_norm: bool = False
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    gemma_norms: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_layers: tuple[bool, ...] = ()
    post_norms: bool = False
    qk_norm_whole: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    def layer_window(self, layer: int) -> int | None:
        """The number of positions a query of ``layer`` sees (None: the whole sequence)."""
        if self.sliding_window is None or (self.window_layers and not self.window_layers[layer]):
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions are rotated (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def context_window(self) -> int:
        """The longest sequence (prompt and output) the network computes exactly."""
        return min(limit for limit, _ in self._context_limits())

    def context_window_reason(self) -> str:
        """Why ``context_window`` is below ``max_position_embeddings`` ("" where it is not)."""
        limit = self.context_window
        return next((why for length, why in self._context_limits() if length == limit and why), "")

    def _context_limits(self) -> list[tuple[int, str]]:
        limits = [(self.max_position_embeddings, "")]
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "longrope" and scaling["long_factor"] != scaling["short_factor"]:
            original = scaling["original_max_position_embeddings"]
            limits.append((original, f"its LongRoPE original_max_position_embeddings={original}: past it the "
                                     "model rotates by other factors than those its cached keys were rotated by"))
        return limits

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a parsed ``config.json``; raises ``ValueError`` for anything unsupported."""
        d = language_model_config(d)
        architecture = _architecture(d)
        defaults = _ARCH_DEFAULTS[architecture]
        missing = [key for key in _REQUIRED if d.get(key) is None]
        if missing:
            raise ValueError(f"config for {architecture} lacks required keys: {', '.join(missing)}")

        heads = int(d["num_attention_heads"])
        kv_heads = d.get("num_key_value_heads", defaults["num_key_value_heads"])
        max_positions = int(d.get("max_position_embeddings") or defaults["max_position_embeddings"])
        # Gemma 2 names it hidden_activation; Gemma's hidden_act, where its config leaves it out.
        activation = d.get("hidden_activation") if architecture in _SANDWICH else d.get("hidden_act")
        activation = activation or defaults.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {activation!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        local_rope_theta = None
        if architecture == "Gemma3ForCausalLM":
            if d.get("use_bidirectional_attention"):
                raise ValueError("use_bidirectional_attention=true: this Gemma 3 attends both ways (an encoder); "
                                 "multispec runs causal language models")
            d, local_rope_theta = _gemma3_rope(d)
        rope_theta, rope_scaling = _rope(d, max_positions, architecture)
        head_dim = int(d.get("head_dim") or defaults.get("head_dim") or d["hidden_size"] // heads)
        partial = float(d.get("partial_rotary_factor") or (d.get("rope_parameters") or d.get("rope_scaling") or {}).get(
            "partial_rotary_factor") or 1.0)
        rotary_dim = int(head_dim * partial)
        if not 0 < partial <= 1 or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={partial}: must rotate an even number of each head's "
                             f"{head_dim} dimensions")
        _check_longrope(rope_scaling, rotary_dim)
        return cls(
            architecture=architecture,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=float(d.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
            attention_bias=architecture == "Qwen2ForCausalLM"
            or (architecture in _BIASED and bool(d.get("attention_bias", False))),
            mlp_bias=architecture in ("LlamaForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM")
            and bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id", defaults["bos_token_id"]),
            eos_token_ids=token_id_list(d.get("eos_token_id", defaults["eos_token_id"])),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            **_sliding_window(d, architecture),
            partial_rotary_factor=partial,
            hidden_act=activation,
            gemma_norms=architecture in _GEMMA,
            sandwich_norms=architecture in _SANDWICH,
            local_rope_theta=local_rope_theta,
            **_gemma2_scalars(d, architecture),
            rope_layers=_rope_layers(d, architecture),
            post_norms=architecture == "Olmo2ForCausalLM",
            qk_norm_whole=architecture == "Olmo2ForCausalLM",
            **_granite_multipliers(d, architecture),
        )


_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8}
"""transformers' Gemma3TextConfig defaults for what a multimodal Gemma 3's ``text_config`` leaves out."""


def multimodal(d: dict) -> bool:
    """Whether ``d`` is a multimodal Gemma 3's config (Gemma3ForConditionalGeneration: the 4B model
    and up), whose language model multispec runs: text in, text out."""
    names = d.get("architectures") or []
    return (names[0] if names else d.get("model_type")) in ("Gemma3ForConditionalGeneration", "gemma3")


def language_model_config(d: dict) -> dict:
    """``d`` as its language model's config: a multimodal Gemma 3's ``text_config`` (with
    transformers' defaults for what it leaves out, and the top level's token ids and tying where
    it has none); any other config as it is."""
    if not multimodal(d):
        return d
    given = d.get("text_config") or {}
    if not isinstance(given, dict):
        raise ValueError("text_config: must be a JSON object")
    text = {**_GEMMA3_TEXT_DEFAULTS, **given, "architectures": ["Gemma3ForCausalLM"]}
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if key in d and key not in given:
            text[key] = d[key]
    return text


def _architecture(d: dict) -> str:
    """The causal-LM class name, from ``architectures`` or, failing that, ``model_type``."""
    names = d.get("architectures") or []
    architecture = names[0] if names else ARCHITECTURE_OF_MODEL_TYPE.get(d.get("model_type", ""), d.get("model_type"))
    if architecture not in _ARCH_DEFAULTS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_ARCH_DEFAULTS)}"
        )
    return architecture


def _rope_layers(d: dict, architecture: str) -> tuple[bool, ...]:
    """SmolLM3's ``no_rope_layers`` (1: the layer rotates, 0: it does not), or, where config.json
    leaves it out, every ``no_rope_layer_interval``-th layer unrotated, as transformers builds it."""
    if architecture != "SmolLM3ForCausalLM":
        return ()
    layers = int(d["num_hidden_layers"])
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval") or _ARCH_DEFAULTS[architecture]["no_rope_layer_interval"])
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers: must be a list of {layers} flags (1: the layer rotates, 0: it does not)")
    return tuple(bool(f) for f in flags)


def _granite_multipliers(d: dict, architecture: str) -> dict:
    """Granite's four scalars (1.0 each where config.json leaves them out, as transformers' defaults)."""
    if architecture != "GraniteForCausalLM":
        return {}
    return _positive({key: d.get(key, 1.0) for key in ("embedding_multiplier", "residual_multiplier",
                                                        "attention_multiplier", "logits_scaling")})


def _gemma2_scalars(d: dict, architecture: str) -> dict:
    """Gemma 2's attention scale and soft caps, with its defaults where config.json leaves them out
    (a cap given as null is none)."""
    if architecture not in _SANDWICH:
        return {}
    defaults = _ARCH_DEFAULTS[architecture]
    return _positive({key: d[key] if key in d else defaults[key]
                      for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")},
                     nullable=("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"))


def _positive(values: dict, nullable: tuple[str, ...] = ()) -> dict:
    """``values`` as floats, each a positive number (or None, for the keys in ``nullable``), else a
    ValueError naming the key."""
    for key, value in values.items():
        if value is None and key in nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{key}={value!r}: must be a positive number" + (" or null" if key in nullable else ""))
    return {key: float(value) if value is not None else None for key, value in values.items()}


def _sliding_window(d: dict, architecture: str) -> dict:
    """``sliding_window`` and ``window_layers``, as transformers reads them: ``layer_types``
    (per layer, "sliding_attention" or "full_attention") where config.json lists them (but for
    Mistral and Phi-3), else each architecture's rule: Mistral's ``sliding_window`` on every
    layer (4096 where the key is absent, none where it is null); Phi-3's on every layer (none
    where absent); Qwen2's and Qwen3's on the layers from ``max_window_layers`` on, only where
    ``use_sliding_window`` is set; Gemma 2's on every other layer, from the first; Gemma 3's on
    all but every ``sliding_window_pattern``-th (6); SmolLM3's on its unrotated layers, where
    ``use_sliding_window`` is set."""
    layers = int(d["num_hidden_layers"])
    if architecture == "MistralForCausalLM":
        window = d.get("sliding_window", 4096)
    elif architecture in _SANDWICH:
        window = d.get("sliding_window", 4096)
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM"):
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
    elif architecture == "Phi3ForCausalLM":
        window = d.get("sliding_window")
    else:
        window = None
    if not window:
        return {"sliding_window": None}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r}: must be a positive whole number of positions or null")
    # Mistral's and Phi-3's networks window every layer, whatever a config's layer_types say.
    layer_types = d.get("layer_types") if architecture not in ("MistralForCausalLM", "Phi3ForCausalLM") else None
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != layers
                or any(t not in ("sliding_attention", "full_attention") for t in layer_types)):
            raise ValueError(f"layer_types: must be a list of {layers} entries, each 'sliding_attention' or "
                             "'full_attention'")
        flags = [t == "sliding_attention" for t in layer_types]
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        flags = [i >= int(d.get("max_window_layers", 28)) for i in range(layers)]
    elif architecture == "Gemma2ForCausalLM":
        flags = [i % 2 == 0 for i in range(layers)]
    elif architecture == "Gemma3ForCausalLM":  # all but every sliding_window_pattern-th layer
        pattern = d.get("sliding_window_pattern") or _ARCH_DEFAULTS[architecture]["sliding_window_pattern"]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern={pattern!r}: must be a positive whole number")
        flags = [(i + 1) % pattern != 0 for i in range(layers)]
    elif architecture == "SmolLM3ForCausalLM":
        flags = [not rotates for rotates in _rope_layers(d, architecture)]
    else:
        flags = [True] * layers
    if not any(flags):
        return {"sliding_window": None}
    return {"sliding_window": window, "window_layers": () if all(flags) else tuple(flags)}


def _gemma3_rope(d: dict) -> tuple[dict, float]:
    """Gemma 3's two rotations: ``d`` with the full-attention layers' (``rope_theta`` and
    ``rope_scaling``, or ``rope_parameters["full_attention"]``) as the config's own, and the base of
    the windowed layers' plain RoPE (``rope_local_base_freq``, or
    ``rope_parameters["sliding_attention"]``)."""
    params = d.get("rope_parameters")
    local = d.get("rope_local_base_freq") or _ARCH_DEFAULTS["Gemma3ForCausalLM"]["rope_local_base_freq"]
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        sliding = params.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters['sliding_attention']: RoPE type {sliding['rope_type']!r} on the "
                             "windowed layers is not supported (plain RoPE is)")
        local = sliding.get("rope_theta") or local
        d = {**d, "rope_parameters": params.get("full_attention") or {}}
    return d, float(_positive({"rope_local_base_freq": local})["rope_local_base_freq"])


def _rope(d: dict, max_positions: int, architecture: str) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either the old or the new spelling."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or _ARCH_DEFAULTS[architecture].get(
        "rope_theta", 10000.0))
    params.pop("partial_rotary_factor", None)  # ModelConfig's own field
    rope_type = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's earlier names for it, as transformers reads them
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type in _NEEDS_ORIGINAL_MAX:
        # A top-level value wins, as in transformers (some configs keep it outside the dict), and
        # so does Phi-3's default for it, which transformers' Phi3Config always holds.
        original = (d.get("original_max_position_embeddings")
                    or _ARCH_DEFAULTS[architecture].get("original_max_position_embeddings")
                    or params.get("original_max_position_embeddings"))
        params["original_max_position_embeddings"] = int(original or max_positions)
    if rope_type not in ("yarn", "longrope") and params.get("factor") is None:
        raise ValueError(f"RoPE type {rope_type!r} needs a 'factor' in the config")
    return theta, {"rope_type": rope_type, **params}


def _check_longrope(scaling: dict | None, rotary_dim: int) -> None:
    """LongRoPE's two lists of factors, one per rotated pair of dimensions, or a ValueError."""
    if not scaling or scaling["rope_type"] != "longrope":
        return
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2 or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors):
            raise ValueError(f"RoPE type 'longrope' needs {key!r}: a list of {rotary_dim // 2} positive numbers")


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file as a dict ({} where it is absent); malformed JSON, or JSON that is
    not an object, is a ValueError naming the file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def token_id_list(value: int | list[int] | None) -> list[int]:
    """Token ids stored as one int, a list, or null, as a list."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
