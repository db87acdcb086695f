"""The Llama family (Llama, SmolLM, Mistral, Qwen2) in plain PyTorch, over packed tokens.

The network never sees a batch dimension: every call runs ``T`` new tokens of any number of
sequences concatenated, so each matrix multiply sees exactly the tokens that exist. How the
tokens attend to each other and to cached keys is the business of the ``attention`` object the
caller passes in (the engine's KV cache); the network only produces q, k, v per layer and
applies the result. Parameter names match the Hugging Face checkpoints so a state dict loads
as it is.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from multispec.models.config import ModelConfig
from multispec.models.rope import rope_inv_freq


class Attention(Protocol):
    """Per-forward attention over the KV cache: stores k/v of the new tokens, returns [T, H, D]."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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
        # Llama's attention_bias covers o_proj too; Qwen2 biases only q/k/v.
        o_bias = bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)

        self.fused = False

    def fuse(self) -> None:
        """One matrix product for q, k and v: their weights become views of one concatenated
        tensor (no extra memory, the three parameters keep their names and values)."""
        _fuse(self, "qkv", self.q_proj, self.k_proj, self.v_proj)
        self.fused = True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.fused:
            # q and k lie side by side in the fused output: one rotation covers both.
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(t, heads + 2 * kv_heads, -1)
            qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        else:
            q = apply_rope(self.q_proj(x).view(t, heads, self.head_dim), cos, sin)
            k = apply_rope(self.k_proj(x).view(t, kv_heads, self.head_dim), cos, sin)
            v = self.v_proj(x).view(t, kv_heads, self.head_dim)
        out = attention.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.fused = False

    def fuse(self) -> None:
        """One matrix product for the gate and up projections (see ``SelfAttention.fuse``)."""
        _fuse(self, "gate_up", self.gate_proj, self.up_proj)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _fuse(owner: nn.Module, name: str, *linears: nn.Linear) -> None:
    """Weight and bias of the given layers concatenated, kept by ``owner`` as buffers
    ``<name>_weight`` / ``<name>_bias`` (None where the layers have no bias). Not saved: the
    layers' own parameters, now views of them, are."""
    weight = torch.cat([layer.weight.detach() for layer in linears])
    bias = torch.cat([layer.bias.detach() for layer in linears]) if linears[0].bias is not None else None
    owner.register_buffer(f"{name}_weight", weight, persistent=False)
    owner.register_buffer(f"{name}_bias", bias, persistent=False)
    start = 0
    for layer in linears:
        rows = layer.weight.shape[0]
        layer.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention: Attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Packed-token causal LM: ``forward(token_ids[T], positions[T], attention) -> logits[T, V]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope_len = 0
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def output_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def rope_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, max_position), grown on demand and kept between forwards."""
        if self._rope_cache is None or max_position > self._rope_len:
            length = max(max_position, 2 * self._rope_len, 1024)
            inv_freq, scale = rope_inv_freq(self.config, length)
            angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            dtype = self.model.embed_tokens.weight.dtype
            device = self.model.embed_tokens.weight.device
            self._rope_cache = ((angles.cos() * scale).to(device, dtype), (angles.sin() * scale).to(device, dtype))
            self._rope_len = length
        return self._rope_cache

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        cos_table, sin_table = self.rope_tables(int(positions.max()) + 1)
        cos, sin = cos_table[positions], sin_table[positions]
        x = self.model.embed_tokens(token_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.output_weight()).float()

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every token, or only for ``logit_rows`` (a prefill needs just its last row)."""
        hidden = self.hidden_states(token_ids, positions, attention)
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        return self.logits(hidden)

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "LlamaForCausalLM":
        """Build the network on the meta device and give it its own copy of the checkpoint's tensors.

        The copy matters for speed: tensors read from safetensors live in file-backed (memory
        mapped) pages, and small-batch decoding, which streams every weight once per step, runs
        about 7% slower from those than from ordinary memory. On an accelerator the copy is the
        upload."""
        with torch.device("meta"):
            model = cls(config)
        expected = set(model.state_dict())
        given = {k for k in tensors if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            given.discard("lm_head.weight")
        missing, unexpected = sorted(expected - given), sorted(given - expected)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {config.architecture} layout: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.load_state_dict({k: tensors[k].to(device=device, dtype=dtype, copy=True) for k in expected}, assign=True)
        for layer in model.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return model.eval()
