"""The Llama family (Llama, SmolLM, Mistral, Qwen, Phi-3, Gemma, Granite) in plain PyTorch, over packed tokens.

The network never sees a batch dimension: every call runs ``T`` new tokens of any number of
sequences concatenated, so each matrix multiply sees exactly the tokens that exist. How the
tokens attend to each other and to cached keys is the business of the ``attention`` object the
caller passes in (the engine's KV cache); the network only produces q, k, v per layer and
applies the result. Parameter names match the Hugging Face checkpoints so a state dict loads
as it is.

A decode step on a CPU where the compiled kernels are built runs the whole layer stack in one call
(``multispec.kernels.decode_layers``: the same products, norms, rotation and activation, rounded
where these modules round, with the compiled attention inside); the modules below are the
reference it is tested against and the path for prefill, other devices and other attentions.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from multispec import kernels
from multispec.models.config import ModelConfig
from multispec.models.pages import huge_page_arena, release_free_heap
from multispec.models.rope import rope_inv_freq


class Attention(Protocol):
    """Per-forward attention over the KV cache: stores k/v of the new tokens, returns [T, H, D]."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


PACK_ROWS = 16
"""The row count packed weights are laid out for. Any row count runs on them; measured on a 2-core
AVX512-BF16 CPU, a layer stack's products at 1 to 512 rows ran within 10% of the best of the hints
1, 16 and 128 at every row count, in bf16 and float32 (``experiments/packed_gemm.py``)."""


STREAM_ROWS = 48
"""Products of at most this many rows stream their weight through the AMX tiles
(``multispec/kernels/stream_gemm.cpp``) where the CPU has them, one pass over the weight: a
layer stack's products and the output head ran 1.3-1.4x faster than oneDNN's prepacked product
from 1 to 32 rows on a 2-core Xeon with AMX, 1.19x at 40 and 1.11x at 48 (since passes of more
than 16 rows ask for their weight ahead), 0.95x at 56 and 64 rows, which take two passes
(``experiments/stream_gemm.py``)."""

VECTOR_STREAM_ROWS = 512
"""Products of at most this many rows stream their weight through AVX512-BF16 vectors where the
CPU has those but no AMX: a layer stack's products ran 1.1-1.7x faster than oneDNN's prepacked
product at every row count from 1 to 128 on a 2-core AMD EPYC (Zen 5), 1.14x at 256 and 1.05x at
512 rows (``experiments/stream_gemm.py``)."""


F32_STREAM_ROWS = 512
"""Products of at most this many rows stream their float32 weight through AVX2 vectors where the
CPU has AVX2 and FMA but no AVX-512 (float32 is the default dtype there): a layer stack's products
(30 layers and the output head) ran 1.4x faster than oneDNN's prepacked product at 1 row, 1.8-2.2x
at 4-16, 1.4-1.5x at 32-64 and 1.2x at 128-512 rows on a 2-core AMD EPYC (Zen 2), about 0.17
TFLOP/s from 64 rows on against 0.13-0.14 (``experiments/stream_gemm.py``)."""


AFFINE_ROWS = 10
"""Products of at most this many rows read their float32 weight from its integer blocks
(``affine_pack`` in ``multispec/kernels/stream_gemm.cpp``) where the weight is such blocks (a GGUF
file's quantised weights, dequantised) and the float32 product streams on AVX2: a third of the
bytes, the same result bit for bit. All of the default model's products took 0.41x the float32
stream's time at 1 row, 0.44x at 4, 0.75x at 8, 0.91x at 10, 1.02x at 11 and 1.17x at 16 rows on a
2-core Zen 2 (rebuilding the weights costs arithmetic that only pays while the product waits on
memory); plain decode steps 0.48x at 1 sample, 0.54x at 4, 0.81x at 8, 0.93x at 10 and 1.01x at 11
(``experiments/affine_weights.py``)."""


def affine_rows() -> int:
    """The most rows a float32 product reads its weight's integer blocks for now (0: none; the
    float32 streaming product must run here, and MULTISPEC_AFFINE=0 turns it off, for comparisons)."""
    if kernels.stream_kind() != 3 or os.environ.get("MULTISPEC_AFFINE") == "0":
        return 0
    return AFFINE_ROWS


def stream_rows() -> int:
    """The most rows a product streams its weight for on this CPU now (0: none, see
    ``multispec.kernels.stream_kind``)."""
    return {2: STREAM_ROWS, 1: VECTOR_STREAM_ROWS, 3: F32_STREAM_ROWS}.get(kernels.stream_kind(), 0)


def packing_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be prepacked for the CPU's GEMM library (oneDNN)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class Projection:
    """``x @ weight.T + bias`` for 2-D ``x``, the weight optionally prepacked.

    A plain weight handed to the CPU's matrix library is reordered into its blocked layout on every
    call; for the few rows of a decode step that reorder costs as much as the product itself.
    Packing once at load halves the time of a step's products at 4 to 16 rows (bf16 and float32
    alike, see ``experiments/packed_gemm.py``); the packed weight is an opaque tensor that only this
    product reads, so the plain one can be released."""

    __slots__ = ("weight", "bias", "packed", "shape", "stream", "affine")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        self.shape = tuple(weight.shape)
        self.packed = pack
        self.stream = _stream_layout(weight) if pack else None
        """The weight laid out for the streaming product of ``stream_rows()`` rows or fewer, where
        the CPU has AMX or AVX512-BF16, or AVX2 in float32 (a second copy of the weight); else None."""
        self.affine = _affine_layout(weight) if self.stream is not None else None
        """A float32 weight that is blocks of small integers on a scale, as those blocks (a third of
        its size), for products of ``affine_rows()`` rows or fewer; else None."""
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS) if pack else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.affine is not None and x.shape[0] <= affine_rows():
            return torch.ops.multispec.stream_linear(x, self.affine, self.bias)
        if self.stream is not None and x.shape[0] <= stream_rows():
            return torch.ops.multispec.stream_linear(x, self.stream, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense(self) -> torch.Tensor:
        """The weight as an ordinary [out, in] tensor."""
        return self.weight.to_dense() if self.packed else self.weight


class RMSNorm(nn.Module):
    """Llama's RMS norm: the normalised row rounded to x's dtype, then times the weight; ``gemma``:
    Gemma's, times 1 + the weight in float32, then rounded; ``float32``: OLMo 2's, times the
    weight in float32, then rounded."""

    def __init__(self, size: int, eps: float, gemma: bool = False, float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.gemma = gemma
        self.float32 = float32 or gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return self.library_norm(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float32:
            return (x * (1.0 + self.weight.float() if self.gemma else self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def library_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The same through torch's own ``rms_norm`` (float32, then the weight in x's dtype): one
        call instead of five element-wise operations, for devices where a step is bound by
        dispatching its operations (a GPU). On the CPU the element-wise form stays: its prefill
        and portable decode paths are what the compiled kernels are checked against."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.float32:
            return (normed * (1.0 + self.weight.float() if self.gemma else self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by per-token angles; halves layout, as the HF checkpoints store q/k."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        # Llama's and Qwen3's attention_bias covers o_proj too; Qwen2 biases only q/k/v.
        o_bias = bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        # Qwen3 and Gemma 3: each head of q and k RMS-normalised before the rotation.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.gemma_norms) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.gemma_norms) if config.qk_norm else None
        # OLMo 2: q and k each normalised across all their heads at once.
        self.whole_norms = config.qk_norm_whole
        if self.whole_norms:
            self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps, float32=True)
            self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps, float32=True)
        self.rotates = config.rope_layers[layer] if config.rope_layers else True
        """False for SmolLM3's unrotated ("NoPE") layers."""

        self.fused = False

    def fuse(self, pack: bool = False) -> None:
        """One matrix product for q, k and v (see ``_fuse``); ``pack``: their weights and o's prepacked."""
        self.qkv = _fuse(self, self.q_proj, self.k_proj, self.v_proj, pack=pack)
        self.o = _fuse(self, self.o_proj, pack=pack)
        self.fused = True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.fused and self.whole_norms:
            flat = self.qkv(x)
            q_end, k_end = heads * self.head_dim, (heads + kv_heads) * self.head_dim
            q = self.q_norm(flat[:, :q_end]).view(t, heads, self.head_dim)
            k = self.k_norm(flat[:, q_end:k_end]).view(t, kv_heads, self.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = flat[:, k_end:].view(t, kv_heads, self.head_dim)
        elif self.fused:
            # q and k lie side by side in the fused output: one rotation covers both.
            qkv = self.qkv(x).view(t, heads + 2 * kv_heads, -1)
            qk = qkv[:, : heads + kv_heads]
            if self.q_norm is not None:
                qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
            if self.rotates:
                qk = apply_rope(qk, cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            if self.whole_norms:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.view(t, heads, self.head_dim), k.view(t, kv_heads, self.head_dim)
            if self.q_norm is not None and not self.whole_norms:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotates:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = self.v_proj(x).view(t, kv_heads, self.head_dim)
        out = attention.attend(self.layer, q, k, v).reshape(t, heads * self.head_dim)
        return self.o(out) if self.fused else self.o_proj(out)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}
"""The MLP gate's activation for each ``hidden_act`` a config may name."""
STACK_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}
"""Each activation's number in the compiled layer stack (``decode_layers``' ``activation``)."""


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[config.hidden_act]
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.fused = False

    def fuse(self, pack: bool = False) -> None:
        """One matrix product for the gate and up projections (see ``SelfAttention.fuse``)."""
        self.gate_up = _fuse(self, self.gate_proj, self.up_proj, pack=pack)
        self.down = _fuse(self, self.down_proj, pack=pack)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def _fuse(owner: nn.Module, *linears: nn.Linear, pack: bool) -> Projection:
    """One product for the given layers: their weights (and biases) concatenated.

    Unpacked, the layers' parameters become views of the concatenation (no extra memory, names and
    values kept). Packed, the product holds the only copy of the weights: the layers' weights move
    to the meta device (shape kept, memory released) and ``state_dict`` reads them back from the
    packed copy."""
    weight = torch.cat([layer.weight.detach() for layer in linears])
    bias = torch.cat([layer.bias.detach() for layer in linears]) if linears[0].bias is not None else None
    product = Projection(weight, bias, pack)
    start = 0
    for layer in linears:
        rows = layer.weight.shape[0]
        part = weight[start:start + rows]
        layer.weight = nn.Parameter(part.to("meta") if pack else part, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    if pack and not getattr(owner, "_unpacks", False):
        owner._register_state_dict_hook(_unpacked_state)
        owner._unpacks = True
    return product


def _unpacked_state(module: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """``state_dict`` of a layer whose weights are packed: each weight read back from its product."""
    groups = ([("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",))] if isinstance(module, SelfAttention)
              else [("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))])
    for product, names in groups:
        dense, start = getattr(module, product).dense(), 0
        for name in names:
            rows = getattr(module, name).weight.shape[0]
            state[f"{prefix}{name}.weight"] = dense[start:start + rows]
            start += rows


class DecoderLayer(nn.Module):
    """Llama's block: x + attention(norm(x)), then + mlp(norm(x)), the second norm named
    ``post_attention_layernorm``; with ``sandwich_norms`` (Gemma 2) that norm is applied to the
    attention's output, the MLP's input has ``pre_feedforward_layernorm`` and its output
    ``post_feedforward_layernorm``; with ``post_norms`` (OLMo 2) only the outputs are normalised."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention(config, layer)
        self.mlp = MLP(config)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma_norms,  # noqa: E731
                               config.post_norms)
        self.sandwich, self.post_only = config.sandwich_norms, config.post_norms
        if not self.post_only:
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
        if self.sandwich or self.post_only:
            self.post_feedforward_layernorm = norm()

    def forward(self, x, cos, sin, attention: Attention):
        if self.post_only:  # OLMo 2
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attention))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attention))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma_norms, config.post_norms)
        self.embed_scale = config.hidden_size ** 0.5 if config.gemma_norms else None
        """Gemma's embeddings are scaled by sqrt(hidden_size), rounded to their dtype as Gemma's are."""
        self.embedding_multiplier = config.embedding_multiplier
        """Granite's embeddings are scaled by this."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(token_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        return x


def _stream_layout(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` laid out for ``stream_linear`` where that product runs here (compiled kernels;
    bf16 on a CPU with AMX tiles or AVX512-BF16, out and in features multiples of 32; float32 on a
    CPU with AVX2 but no AVX-512, out features a multiple of 16), else None."""
    out_features, in_features = weight.shape
    if weight.device.type != "cpu" or weight.dtype != kernels.stream_dtype():
        return None
    bf16 = weight.dtype == torch.bfloat16
    if out_features % (32 if bf16 else 16) or (bf16 and in_features % 32):
        return None
    return torch.ops.multispec.stream_pack(weight.detach())


def _affine_layout(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s integer blocks for ``stream_linear`` where it is such blocks and the float32
    streaming product runs here, else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or kernels.stream_dtype() != torch.float32:
        return None
    return torch.ops.multispec.affine_pack(weight.detach())


def rotary_order(head_dim: int, rotary_dim: int) -> list[int] | None:
    """Where each dimension of a head goes so that a partial rotation becomes a whole one (None
    where every dimension is rotated). transformers rotates the first ``rotary_dim`` dimensions as
    pairs ``rotary_dim / 2`` apart and passes the rest; this order puts those pairs ``head_dim / 2``
    apart, as the network's (and the compiled kernels') rotation pairs them, and the passed
    dimensions where the rotation tables hold cos 1 and sin 0. The same order for q and k leaves
    every attention score as it was."""
    if rotary_dim == head_dim:
        return None
    rotated, passed = rotary_dim // 2, head_dim // 2 - rotary_dim // 2
    first = [*range(rotated), *range(rotary_dim, rotary_dim + passed)]
    return first + [*range(rotated, rotary_dim), *range(rotary_dim + passed, head_dim)]


def network_layout(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under this network's names and in its layout: Phi-3's fused
    ``qkv_proj`` and ``gate_up_proj`` split into the Llama products (the network fuses them again,
    in its own way); an attention scale other than the head width's (Gemma 2's, Granite's) carried
    by q's weights, Granite's residual multiplier by each block's last product; and, where only
    part of each head is rotated, q's and k's dimensions put in ``rotary_order``. Other
    checkpoints come back as they are."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    out = {}
    for name, tensor in tensors.items():
        stem, _, kind = name.rpartition(".")
        if stem.endswith("self_attn.qkv_proj"):
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
            base = stem[: -len("qkv_proj")]
            out.update({f"{base}q_proj.{kind}": q, f"{base}k_proj.{kind}": k, f"{base}v_proj.{kind}": v})
        elif stem.endswith("mlp.gate_up_proj"):
            gate, up = tensor.chunk(2)
            base = stem[: -len("gate_up_proj")]
            out.update({f"{base}gate_proj.{kind}": gate, f"{base}up_proj.{kind}": up})
        else:
            out[name] = tensor
    q_factor = 1.0
    if config.attention_multiplier is not None:
        q_factor = config.attention_multiplier * config.head_dim ** 0.5
    elif config.query_pre_attn_scalar is not None and config.query_pre_attn_scalar != config.head_dim:
        q_factor = (config.head_dim / config.query_pre_attn_scalar) ** 0.5
    # Where q is normalised after its product (Gemma 3), its norm's weight carries the scale.
    q_part = ".self_attn.q_norm." if config.qk_norm else ".self_attn.q_proj."
    factors = {q_part: q_factor, ".self_attn.o_proj.": config.residual_multiplier,
               ".mlp.down_proj.": config.residual_multiplier}
    for part, factor in factors.items():
        # The attention scales scores by head_dim ** -0.5: q (linear in the weights or its norm's
        # weight, and the rotation linear in q) carries any other scale (Gemma 2's and 3's,
        # Granite's); each block's last product carries Granite's residual multiplier. A Gemma
        # norm scales by 1 + its weight: that sum carries the factor.
        shift = 1.0 if config.gemma_norms and part == ".self_attn.q_norm." else 0.0
        if factor != 1.0:
            out = {name: ((tensor.float() + shift) * factor - shift).to(tensor.dtype) if part in name else tensor
                   for name, tensor in out.items()}
    order = rotary_order(config.head_dim, config.rotary_dim)
    if order is None:
        return out
    order = torch.tensor(order)
    for name, tensor in out.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                          "self_attn.k_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            heads = tensor.shape[0] // config.head_dim
            out[name] = tensor.reshape(heads, config.head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)
    return out


class LlamaForCausalLM(nn.Module):
    """Packed-token causal LM: ``forward(token_ids[T], positions[T], attention) -> logits[T, V]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope_len = 0
        self._rope_cache: tuple[torch.Tensor, ...] | None = None
        self.head: Projection | None = None
        self.packed = False
        self.compiled_layers = True
        """Run decode steps as one compiled call of the layer stack where the CPU kernels are built
        (see ``_compiled_stack``); False keeps the layer-by-layer path."""
        self._stack_weights: tuple | None = None
        self._stack_affine: list = []

    def output_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def rope_tables(self, max_position: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, max_position), grown on demand and kept between forwards;
        ``local``: those of the windowed layers' own rotation (``ModelConfig.local_rope_theta``)."""
        if self._rope_cache is None or max_position > self._rope_len:
            length = max(max_position, 2 * self._rope_len, 1024)
            config = self.config
            self._rope_cache = self._rope_table(config, length)
            if config.local_rope_theta is not None:
                self._rope_cache += self._rope_table(replace(config, rope_theta=config.local_rope_theta,
                                                             rope_scaling=None), length)
            self._rope_len = length
        return self._rope_cache[2:] if local else self._rope_cache[:2]

    def _rope_table(self, config: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = rope_inv_freq(config, length)
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        # Dimensions past the rotated ones (partial rotary, laid out by ``rotary_order``) pass
        # unchanged: cos 1 and sin 0, unscaled.
        half = config.head_dim // 2
        cos, sin = torch.ones(length, half), torch.zeros(length, half)
        cos[:, : inv_freq.numel()], sin[:, : inv_freq.numel()] = angles.cos() * scale, angles.sin() * scale
        dtype = self.model.embed_tokens.weight.dtype
        device = self.model.embed_tokens.weight.device
        return torch.cat((cos, cos), dim=-1).to(device, dtype), torch.cat((sin, sin), dim=-1).to(device, dtype)

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        end = int(positions.max()) + 1
        cos_table, sin_table = self.rope_tables(end)
        cos, sin = cos_table[positions], sin_table[positions]
        x = self.model.embed(token_ids)
        config = self.config
        local = None
        if config.local_rope_theta is not None:  # Gemma 3: the windowed layers rotate by their own base
            local_cos, local_sin = self.rope_tables(end, local=True)
            local = (local_cos[positions], local_sin[positions])
        stack = self._compiled_stack(attention, x.shape[0])
        if stack is not None:
            op, weights, args = stack
            *extras, local_layers, windows, softcap = self._stack_extras
            return op(x, cos, sin, *weights, *args, *extras, *(local if local is not None else (None, None)),
                      local_layers, windows, softcap, *getattr(attention, "scratch_args", (None, None)))
        rotations = [(cos, sin)] * len(self.model.layers)
        if local is not None:
            rotations = [local if config.layer_window(i) is not None else rotation
                         for i, rotation in enumerate(rotations)]
        for layer, (cos, sin) in zip(self.model.layers, rotations):
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def _compiled_stack(self, attention: Attention, rows: int | None = None):
        """(op, weights, attention args) where this forward can run as one compiled call of the
        whole layer stack (``multispec.kernels.decode_layers``): a decode step on a CPU whose
        attention runs the compiled kernel, fused products, float32 or bf16; else None. ``rows``,
        the forward's token count, picks the products' weights: integer blocks up to
        ``affine_rows()`` where every product has them, else the streaming layout (also for None)."""
        args_of = getattr(attention, "kernel_args", None)
        args = args_of() if args_of is not None and self.compiled_layers else None
        if args is None or not self.model.layers[0].self_attn.fused:
            return None
        op = kernels.decode_layers()
        if op is None:
            return None
        if self._stack_weights is None:
            layers = self.model.layers
            products = [(layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down) for layer in layers]
            config = self.config
            post_only = config.post_norms  # OLMo 2: no norm before the blocks
            qk_norms = config.qk_norm or config.qk_norm_whole  # per head (Qwen3, Gemma 3) or whole (OLMo 2)
            self._stack_weights = (
                [] if post_only else [layer.input_layernorm.weight for layer in layers],
                [layer.post_attention_layernorm.weight for layer in layers],
                *[part for i in range(4) for part in ([p[i].weight for p in products], [p[i].bias for p in products])],
                self.model.norm.weight, bool(products[0][0].packed),
                [p[i].stream for i in range(4) for p in products] if all(
                    p[i].stream is not None for p in products for i in range(4)) else [],
                [layer.self_attn.q_norm.weight for layer in layers] if qk_norms else [],
                [layer.self_attn.k_norm.weight for layer in layers] if qk_norms else [],
                config.num_attention_heads, config.num_key_value_heads, float(config.rms_norm_eps))
            self._stack_affine = [p[i].affine for i in range(4) for p in products] if all(
                p[i].affine is not None for p in products for i in range(4)) else []
            sandwich = config.sandwich_norms
            self._stack_extras = (
                [layer.pre_feedforward_layernorm.weight for layer in layers] if sandwich else [],
                [layer.post_feedforward_layernorm.weight for layer in layers] if sandwich or post_only else [],
                1 if config.gemma_norms else 2 if post_only else 0, post_only, config.qk_norm_whole,
                STACK_ACTIVATIONS[config.hidden_act],
                [int(flag) for flag in config.rope_layers],
                [int(config.layer_window(i) is not None) for i in range(len(layers))]
                if config.local_rope_theta is not None else [],
                [config.layer_window(i) or 0 for i in range(len(layers))] if config.sliding_window else [],
                float(config.attn_logit_softcapping or 0.0))
        # The streaming products' row limit, read now: MULTISPEC_AMX / MULTISPEC_STREAM / MULTISPEC_AFFINE
        # may switch it. Integer blocks where every product has them and the step's rows are within
        # their limit, else the streaming layout.
        weights = self._stack_weights  # ..., stream layouts, q norms, k norms, heads, kv heads, eps
        limit = affine_rows() if self._stack_affine and rows is not None else 0
        if rows is not None and rows <= limit:
            return op, (*weights[:-6], self._stack_affine, limit, *weights[-5:]), args
        return op, (*weights[:-5], stream_rows(), *weights[-5:]), args

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The output head's logits, in float32 (``float32=False``: in the model's dtype, for a
        consumer that converts as it reads, such as the compiled softmax of the decode step)."""
        out = self.head(hidden) if self.head is not None else F.linear(hidden, self.output_weight())
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), in float32 whatever is asked
            return torch.tanh(out.float() / cap) * cap
        if self.config.logits_scaling != 1.0:  # Granite: divided, in float32 whatever is asked
            return out.float() / self.config.logits_scaling
        return out.float() if float32 else out

    def fuse(self, pack: bool) -> None:
        """Every layer's products fused (and, ``pack``, their weights prepacked, see ``Projection``);
        packed, the output head gets a packed copy too (the plain one stays: it is also the
        embedding, or what a draft head reads its rows from)."""
        for layer in self.model.layers:
            layer.self_attn.fuse(pack)
            layer.mlp.fuse(pack)
        self.head = Projection(self.output_weight(), None, pack=True) if pack else None
        self.packed = pack
        self._stack_weights = None
        if pack:
            self._streamed_on_huge_pages()

    def _streamed_on_huge_pages(self) -> None:
        """The layouts a decode step streams (each product's ``stream`` and ``affine``, the output
        head's) moved onto 2 MiB pages where the system grants them (``pages.huge_page_arena``),
        one at a time, each original handed back to the system as its copy is made."""
        projections = [p for layer in self.model.layers
                       for p in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down)]
        projections += [self.head] if self.head is not None else []
        arena = huge_page_arena([t for p in projections for t in (p.stream, p.affine)])
        if arena is None:
            return
        release_free_heap()
        for p in projections:
            p.stream = arena.copy(p.stream)
            p.affine = arena.copy(p.affine)
            release_free_heap()  # the originals just freed, else resident (0.7 GB more at the peak)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every token, or only for ``logit_rows`` (a prefill needs just its last row)."""
        hidden = self.hidden_states(token_ids, positions, attention)
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        return self.logits(hidden)

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     pack: bool = True) -> "LlamaForCausalLM":
        """Build the network on the meta device and give it its own copy of the checkpoint's tensors.

        The copy matters for speed: tensors read from safetensors live in file-backed (memory
        mapped) pages, and small-batch decoding, which streams every weight once per step, runs
        about 7% slower from those than from ordinary memory. On an accelerator the copy is the
        upload. ``pack``: prepack the products' weights where the CPU library can (see
        ``Projection``; False keeps plain weights, as on an accelerator)."""
        with torch.device("meta"):
            model = cls(config)
        expected = set(model.state_dict())
        tensors = network_layout(config, tensors)
        given = {k for k in tensors if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            given.discard("lm_head.weight")
        missing, unexpected = sorted(expected - given), sorted(given - expected)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {config.architecture} layout: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.load_state_dict({k: tensors[k].to(device=device, dtype=dtype, copy=True) for k in expected}, assign=True)
        model.fuse(pack=pack and packing_available(dtype, device))
        return model.eval()
