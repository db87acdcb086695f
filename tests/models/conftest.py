"""Shared fixtures for the model-loading tests.

Converting the default GGUF takes ~20 s, so it happens once per session into a
private cache directory, and every test that needs the real model shares it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from multispec.models import DEFAULT_MODEL, Checkpoint, load_checkpoint, resolve_model
from multispec.models.loading import default_cache_dir

# A Llama-3-like template: BOS written by the template, loop controls, tojson, raise_exception,
# strftime_now, a generation block, whitespace that only trim_blocks/lstrip_blocks remove, and a
# key tested for presence.
TINY_CHAT_TEMPLATE = (
    "{% set year = strftime_now('%Y') %}{{ bos_token }}{% for m in messages %}\n"
    "  {% if m['role'] not in ['system', 'user', 'assistant'] %}\n"
    "    {{ raise_exception('bad role ' + m['role']) }}\n"
    "  {% endif %}\n"
    "  {% if m['role'] == 'system' and not loop.first %}{% continue %}{% endif %}\n"
    "<|start|>{{ m['role'] }}{% if 'name' in m %} ({{ m['name'] }}){% endif %}\n"
    "{% generation %}{{ m['content'] | trim }}{% endgeneration %}"
    "{% if m.get('meta') %} {{ m['meta'] | tojson }}{% endif %}"
    "<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
TINY_SPECIALS = ["<unk>", "<s>", "</s>", "<|start|>", "<|end|>"]


def write_tiny_tokenizer(directory: Path) -> None:
    """A small byte-level BPE tokenizer with Llama-style special tokens that prepends BOS, trained on the spot."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=TINY_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["Hello world! The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x * 2\n"]
    tok.train_from_iterator(corpus * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", TINY_SPECIALS.index("<s>"))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},  # the older spelling
        "unk_token": "<unk>",
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def like_trained(model, norms: bool = False, sharpen: float | None = None) -> None:
    """Moves a randomly initialised transformers model toward a trained one where the difference
    would hide a mistake: ``norms``, norm weights of their own (each starts at 1, or at 0 for
    Gemma's 1 + weight, so a norm left out or misapplied changes little); ``sharpen``, q and k
    that many times larger (nearly uniform attention hides a wrong rotation, scale or cap)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qk_rows = (config.num_attention_heads + config.num_key_value_heads) * head_dim  # of Phi-3's fused q/k/v
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if norms and name.endswith("norm.weight"):
                weight.add_(0.3 * torch.randn_like(weight))
            if sharpen and (".q_proj." in name or ".k_proj." in name):
                weight.mul_(sharpen)
            if sharpen and ".qkv_proj." in name:
                weight[:qk_rows] *= sharpen


# Hugging Face parameter names (after "model.layers.{i}.") and their llama.cpp names.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused products
}
_GGUF_GEMMA2_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_OLMO2_NORMS = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GGUF_PERMUTED = ("llama", "smollm3", "granite")
"""Architectures llama.cpp converts as Llama, reordering q's and k's rows."""


def _gguf_name(hf_name: str, arch: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        names = {**_GGUF_LAYER_NAMES, **_GGUF_GEMMA2_NORMS} if arch in ("gemma2", "gemma3") else _GGUF_LAYER_NAMES
        names = {**names, **_GGUF_OLMO2_NORMS} if arch == "olmo2" else names
        return f"blk.{layer}.{names[rest]}.{kind}"
    return f"{_GGUF_NAMES[stem]}.{kind}"


def _interleave_rotary_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (weights and biases) for the architectures it converts as Llama:
    within each head the two rotary halves [x0..x(d/2-1) | y0..y(d/2-1)] are stored as pairs
    x0 y0 x1 y1 ..."""
    head_dim = weight.shape[0] // heads
    return weight.reshape(heads, 2, head_dim // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, model, tokenizer_dir: Path, arch: str, granite_scales: bool = True,
                    extra=None, add_bos: bool = False) -> None:
    """Write a transformers model as an F32 GGUF, the way llama.cpp's converter lays it out,
    with the byte-level tokenizer from ``tokenizer_dir`` in GGUF metadata (``granite_scales``
    False: a Granite file without its four scales, for what a reader assumes then; ``extra``,
    called with the writer before the tensors, adds what a test needs; ``add_bos``: the file says
    to prepend BOS, as the tiny tokenizer does)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_vocab_size(config.vocab_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # Gemma 3's: per layer type
    writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(config, "head_dim", None) and arch != "granite":  # llama.cpp's converter ignores Granite's
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "gemma2":  # llama.cpp writes the caps and the window, not query_pre_attn_scalar
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":  # the window and the full layers' scaling; llama.cpp takes the rest as Gemma 3's
        writer.add_sliding_window(config.sliding_window)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "granite" and granite_scales:  # llama.cpp's names for Granite's four multipliers
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch in ("smollm3", "granite"):  # LlamaModel's converter writes the rotated width
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if arch == "phi3":  # as llama.cpp's converter writes a Phi-3 model's rotation and window
        head_dim = config.hidden_size // config.num_attention_heads
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(config.sliding_window or 0)
        writer.add_pad_token_id(0)  # Phi3Config's default (32000) lies outside the tiny vocabulary
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in TINY_SPECIALS else 1 for token, _ in vocab])
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    writer.add_bos_token_id(spec["model"]["vocab"]["<s>"])
    writer.add_eos_token_id(spec["model"]["vocab"]["<|end|>"])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)

    if extra is not None:
        extra(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch in _GGUF_PERMUTED and ".q_proj." in name:
            tensor = _interleave_rotary_halves(tensor, config.num_attention_heads)
        if arch in _GGUF_PERMUTED and ".k_proj." in name:
            tensor = _interleave_rotary_halves(tensor, config.num_key_value_heads)
        if arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):  # llama.cpp stores 1 + weight
            tensor = tensor + 1
        writer.add_tensor(_gguf_name(name, arch), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """The session's fresh cache (tests/conftest.py points MULTISPEC_CACHE at it): one conversion
    of the default GGUF serves every test, the CLI subprocesses included."""
    return default_cache_dir()


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_checkpoint(default_gguf, model_cache_dir) -> Checkpoint:
    """The default model, converted from its GGUF into the session cache."""
    return load_checkpoint(default_gguf, cache_dir=model_cache_dir)


@pytest.fixture(scope="session")
def hf_default_model(default_gguf):
    """transformers' own float32 model loaded from the default GGUF: the reference (~15 s)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random two-layer Llama saved by transformers, with the tiny tokenizer beside it."""
    import transformers

    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory
