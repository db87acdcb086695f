"""ModelConfig.from_hf_dict reads config.json the way transformers does.

Each case is parsed by transformers' own config class and model (built on the meta
device), and every field is compared with what transformers ends up using, so
per-architecture defaults and both RoPE spellings are checked against the reference.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from multispec.models.config import ModelConfig, token_id_list

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4)
PHI3 = dict(model_type="phi3", **SMALL, pad_token_id=0)  # Phi3Config's default pad id lies past this vocabulary

CASES = {
    # Only the required keys: everything else comes from each architecture's defaults.
    "llama-minimal": dict(architectures=["LlamaForCausalLM"], model_type="llama", **SMALL),
    "mistral-minimal": dict(architectures=["MistralForCausalLM"], model_type="mistral", **SMALL),
    "qwen2-minimal": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **SMALL),
    "llama-everything": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", **SMALL, num_key_value_heads=2, head_dim=24,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, bos_token_id=7, eos_token_id=[8, 9], rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 1024},
    ),
    "qwen2-yarn-old-spelling": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", **SMALL, num_key_value_heads=1,
        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=5,
        rope_scaling={"type": "yarn", "factor": 4.0},
    ),
    "mistral-new-spelling": dict(
        model_type="mistral", **SMALL, num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
    ),
    "llama-dynamic": dict(
        model_type="llama", **SMALL, rope_theta=30000.0, rope_scaling={"type": "dynamic", "factor": 3.0},
    ),
    "qwen3-minimal": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **SMALL),
    "qwen3-everything": dict(
        model_type="qwen3", **SMALL, num_key_value_heads=2, head_dim=48, attention_bias=True, tie_word_embeddings=True,
        eos_token_id=[3, 4], rope_theta=1000000.0,
    ),
    # Sliding windows: Mistral's is on unless null; Qwen's only with use_sliding_window, from
    # max_window_layers on (none where that is every layer).
    "mistral-window-off": dict(model_type="mistral", **SMALL, sliding_window=None),
    "mistral-window-64": dict(model_type="mistral", **SMALL, sliding_window=64),
    "qwen2-window-unused": dict(model_type="qwen2", **SMALL, sliding_window=32768, use_sliding_window=False),
    "qwen2-window-used": dict(model_type="qwen2", **{**SMALL, "num_hidden_layers": 3}, sliding_window=128,
                              use_sliding_window=True, max_window_layers=1),
    "qwen3-window-past-the-layers": dict(model_type="qwen3", **SMALL, sliding_window=128, use_sliding_window=True,
                                         max_window_layers=1),
    # Windowed layers named: mixed; named but the window not used.
    "qwen2-window-listed": dict(model_type="qwen2", **{**SMALL, "num_hidden_layers": 3}, sliding_window=128,
                                use_sliding_window=True, layer_types=["sliding_attention", "full_attention",
                                                                      "sliding_attention"]),
    "qwen3-window-listed-unused": dict(model_type="qwen3", **{**SMALL, "num_hidden_layers": 2}, sliding_window=128,
                                       layer_types=["sliding_attention", "full_attention"]),
    # Phi-3: Phi-3-mini-4k's window; Phi-3-mini-128k's LongRoPE under its first name ("su"), the
    # original length given at the top; Phi-4-mini's partial rotation with LongRoPE; factors that
    # are all the same (no switch past the original length, so no limit there).
    "phi3-minimal": dict(architectures=["Phi3ForCausalLM"], **PHI3),
    "phi3-window": dict(**PHI3, sliding_window=2047, eos_token_id=[32000, 32007]),
    "phi3-su": dict(**PHI3, max_position_embeddings=131072, original_max_position_embeddings=4096,
                    rope_scaling={"type": "su", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
                                  "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]}),
    "phi4-mini-like": dict(**PHI3, num_key_value_heads=2, tie_word_embeddings=True,
                           partial_rotary_factor=0.75, max_position_embeddings=131072,
                           original_max_position_embeddings=4096, rope_theta=250000.0,
                           rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5],
                                         "long_factor": [4.0, 4.5, 5.0, 5.5, 6.0, 6.5]}),
    "phi3-same-factors": dict(**PHI3, max_position_embeddings=8192,
                              rope_scaling={"rope_type": "longrope", "short_factor": [1.5] * 8,
                                            "long_factor": [1.5] * 8, "attention_factor": 1.2}),
    # Gemma: its defaults (GELU, 1 + weight norms, tied); Gemma 2's caps, scale and alternating
    # window, also with the window's layers named and the caps turned off.
    "gemma-minimal": dict(architectures=["GemmaForCausalLM"], model_type="gemma", **SMALL),
    "gemma2-minimal": dict(model_type="gemma2", **SMALL),
    "gemma2-27b-like": dict(model_type="gemma2", **SMALL, head_dim=16, query_pre_attn_scalar=24,
                            layer_types=["full_attention"], attn_logit_softcapping=None,
                            final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh"),
    # Gemma 3: 1B's kind (five windowed layers to one full, a local rotation of base 10,000), 4B's
    # (a linear scaling on the full layers only), the rotations written per layer type as
    # transformers v5 writes them, and 27B's attention scale.
    "gemma3-1b-like": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                           **{**SMALL, "num_hidden_layers": 7}, head_dim=32, sliding_window=512,
                           rope_theta=1000000.0, rope_local_base_freq=10000.0, eos_token_id=[1, 106]),
    "gemma3-4b-like": dict(model_type="gemma3_text", **{**SMALL, "num_hidden_layers": 6}, sliding_window=1024,
                           rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=3),
    "gemma3-listed": dict(model_type="gemma3_text", **{**SMALL, "num_hidden_layers": 3}, sliding_window=16,
                          layer_types=["full_attention", "sliding_attention", "full_attention"],
                          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}),
    "gemma3-27b-like": dict(model_type="gemma3_text", **SMALL, head_dim=16, query_pre_attn_scalar=24,
                            attn_logit_softcapping=None, final_logit_softcapping=None),
    # SmolLM3: every fourth layer unrotated, or the layers its list names; a window on those.
    "smollm3-minimal": dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", pad_token_id=0,
                            **{**SMALL, "num_hidden_layers": 8}),
    "smollm3-listed": dict(model_type="smollm3", **SMALL, pad_token_id=0, no_rope_layers=[0], attention_bias=True,
                           mlp_bias=True, rope_theta=5000.0),
    "smollm3-window": dict(model_type="smollm3", pad_token_id=0, **{**SMALL, "num_hidden_layers": 4},
                           use_sliding_window=True, sliding_window=64),
    "gemma2-window-listed": dict(model_type="gemma2", **{**SMALL, "num_hidden_layers": 3}, sliding_window=32,
                                 layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    # Granite: its four multipliers (1.0 each where left out), biases.
    "granite-minimal": dict(architectures=["GraniteForCausalLM"], model_type="granite", **SMALL),
    "granite-3": dict(model_type="granite", **SMALL, num_key_value_heads=2, embedding_multiplier=12.0,
                      residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
                      tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    # OLMo 2: its defaults, and biases.
    "olmo2-minimal": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", **SMALL),
    "olmo2-biased": dict(model_type="olmo2", **SMALL, num_key_value_heads=2, attention_bias=True,
                         rope_theta=500000.0),
}
LONGROPE_LIMITS = {"phi3-su": 4096, "phi4-mini-like": 4096}
"""Where LongRoPE's two factor lists differ, the network stops at the original length: past it
transformers rotates new tokens by the long factors and cached keys keep the short ones."""


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case):
    d = CASES[case]
    ours = ModelConfig.from_hf_dict(d)
    hf = transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    attn = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp

    assert ours.architecture == type(model).__name__
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.head_dim == attn.head_dim
    if hasattr(attn, "qkv_proj"):  # Phi-3's fused q, k and v
        kv_rows = (attn.qkv_proj.out_features - ours.num_attention_heads * attn.head_dim) // 2
        q_bias, gate = attn.qkv_proj.bias, mlp.gate_up_proj
    else:
        kv_rows, q_bias, gate = attn.k_proj.out_features, attn.q_proj.bias, mlp.gate_proj
    assert ours.num_key_value_heads == kv_rows // attn.head_dim
    assert ours.attention_bias == (q_bias is not None)
    assert (attn.o_proj.bias is not None) == (ours.attention_bias and ours.architecture != "Qwen2ForCausalLM")
    has_norms = getattr(attn, "q_norm", None) is not None
    assert has_norms == (getattr(attn, "k_norm", None) is not None)
    assert (ours.qk_norm or ours.qk_norm_whole) == has_norms
    if has_norms:  # per head (Qwen3), or across all heads (OLMo 2)
        assert attn.q_norm.weight.shape[0] == attn.head_dim * (ours.num_attention_heads if ours.qk_norm_whole else 1)
    # Each layer's window as transformers' network applies it: Mistral's and Phi-3's masks put the
    # config's on every layer; the others' layers hold their own.
    if type(model).__name__ in ("MistralForCausalLM", "Phi3ForCausalLM"):
        windows = [hf.sliding_window] * hf.num_hidden_layers
    else:
        windows = [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]
    assert [ours.layer_window(i) for i in range(ours.num_hidden_layers)] == windows
    assert ours.context_window == LONGROPE_LIMITS.get(case, ours.max_position_embeddings)
    assert ours.mlp_bias == (gate.bias is not None)
    layer = model.model.layers[0]
    assert ours.hidden_act == (hf.hidden_activation if hasattr(hf, "hidden_activation") else hf.hidden_act)
    assert ours.gemma_norms == type(model.model.norm).__name__.startswith("Gemma")
    assert ours.sandwich_norms == hasattr(layer, "pre_feedforward_layernorm")
    assert ours.post_norms == ours.qk_norm_whole == (not hasattr(layer, "input_layernorm"))
    for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        assert getattr(ours, field) == getattr(hf, field, None), field
    for field in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        assert getattr(ours, field) == getattr(hf, field, 1.0), field
    assert ours.attention_multiplier == getattr(hf, "attention_multiplier", None)
    rotates = [bool(getattr(layer.self_attn, "use_rope", True)) for layer in model.model.layers]
    assert (list(ours.rope_layers) or [True] * ours.num_hidden_layers) == rotates
    assert ours.eos_token_ids == token_id_list(hf.eos_token_id)

    rope = dict(hf.rope_parameters)
    if "full_attention" in rope:  # Gemma 3: the windowed layers' rotation, and the others'
        assert rope["sliding_attention"]["rope_type"] == "default"
        assert ours.local_rope_theta == rope["sliding_attention"]["rope_theta"]
        rope = dict(rope["full_attention"])
    else:
        assert ours.local_rope_theta is None
    if ours.qk_norm:  # Gemma 3's scale by 1 + weight, as its other norms; Qwen3's by the weight
        assert type(attn.q_norm).__name__.startswith("Gemma") == ours.gemma_norms
    assert ours.rope_theta == rope.pop("rope_theta")
    assert ours.partial_rotary_factor == rope.pop("partial_rotary_factor", 1.0)
    rope.pop("type", None)
    if rope["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling == rope


def test_round_trips_through_transformers_serialisation():
    """transformers v5 writes ``rope_parameters``; reading that back changes nothing."""
    d = CASES["llama-everything"]
    saved = transformers.AutoConfig.for_model(**d).to_dict()
    assert "rope_parameters" in saved
    assert ModelConfig.from_hf_dict(saved) == ModelConfig.from_hf_dict(d)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict(dict(architectures=["GPT2LMHeadModel"], **SMALL))
    with pytest.raises(ValueError, match="gemma4_text"):
        ModelConfig.from_hf_dict(dict(model_type="gemma4_text", **SMALL))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(dict(CASES["gemma3-1b-like"], use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="sliding_attention.*'linear'"):
        ModelConfig.from_hf_dict(dict(CASES["gemma3-1b-like"], rope_parameters={
            "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}))


def test_unsupported_rope_type_is_named():
    d = dict(CASES["llama-minimal"], rope_scaling={"rope_type": "proportional", "factor": 2.0})
    with pytest.raises(ValueError, match="proportional"):
        ModelConfig.from_hf_dict(d)


def test_unsupported_activation_is_named():
    """A checkpoint whose MLP gate has another activation would run as another model."""
    with pytest.raises(ValueError, match="relu2"):
        ModelConfig.from_hf_dict(dict(CASES["llama-minimal"], hidden_act="relu2"))
    assert ModelConfig.from_hf_dict(dict(CASES["llama-minimal"], hidden_act="gelu")).hidden_act == "gelu"
    with pytest.raises(ValueError, match="attn_logit_softcapping=-1"):
        ModelConfig.from_hf_dict(dict(CASES["gemma2-minimal"], attn_logit_softcapping=-1))


@pytest.mark.parametrize("rope, partial, match", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}, 1.0, "short_factor.*8"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8}, 1.0, "long_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [0.0]}, 1.0, "positive"),
    ({"rope_type": "default"}, 0.1, "partial_rotary_factor=0.1"),
    ({"rope_type": "default"}, 1.5, "partial_rotary_factor=1.5"),
])
def test_bad_rotation_is_named(rope, partial, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(dict(CASES["phi3-minimal"], rope_scaling=rope, partial_rotary_factor=partial))


def test_context_window_says_why():
    assert ModelConfig.from_hf_dict(CASES["phi3-minimal"]).context_window_reason() == ""
    window = ModelConfig.from_hf_dict(CASES["phi3-window"])  # a sliding window does not bound the sequence
    assert window.context_window_reason() == "" and window.context_window == window.max_position_embeddings
    assert "original_max_position_embeddings=4096" in ModelConfig.from_hf_dict(
        CASES["phi3-su"]).context_window_reason()


@pytest.mark.parametrize("change,match", [
    (dict(layer_types=["sliding_attention"] * 3), "layer_types: must be a list of 1"),
    (dict(layer_types=["chunked_attention"]), "layer_types"),
    (dict(sliding_window=-4), "sliding_window=-4"),
    (dict(sliding_window=12.5), "sliding_window=12.5"),
])
def test_bad_windows_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(dict(CASES["gemma2-minimal"], **change))


def test_missing_required_key_is_named():
    d = dict(CASES["llama-minimal"])
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_dict(d)


def test_a_multimodal_gemma3_is_read_as_its_language_model():
    """Gemma 3 4B's config.json as published: a text_config that leaves most keys to transformers'
    defaults (the vocabulary, the heads), read as transformers reads its text model's."""
    d = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
         "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                         "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                         "sliding_window": 1024},
         "vision_config": {"model_type": "siglip_vision_model"}}
    ours = ModelConfig.from_hf_dict(d)
    text = transformers.AutoConfig.for_model(**d).text_config
    assert ours == ModelConfig.from_hf_dict({**text.to_dict(), "architectures": ["Gemma3ForCausalLM"],
                                             "eos_token_id": [1, 106]})
    assert (ours.vocab_size, ours.num_attention_heads, ours.head_dim, ours.eos_token_ids) == (262208, 8, 256, [1, 106])
    assert ours.window_layers == tuple((i + 1) % 6 != 0 for i in range(34)) and ours.local_rope_theta == 10000.0
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_dict(dict(d, text_config=[1]))
