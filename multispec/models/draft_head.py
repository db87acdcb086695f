"""A feature-level draft head (EAGLE style) and the decision model that says how deep to draft.

The head drafts from the target's own last hidden state instead of from text: given the target's
final (normed) hidden state ``h_t`` at the last verified position and the token ``x_{t+1}`` sampled
there, one Llama decoder layer predicts the hidden state the target would have at ``t+1``; the
target's own output rows turn it into the next token's distribution; the prediction is fed back
with the drafted token for the next depth. The head attends to a short window of the text before
the root (``HeadConfig.context`` pairs of the target's feature at a position and the token written
after it, the root's pair last) and to the path it drafts in this step. It keeps no cache between
steps: its keys for the window are recomputed from the target's features each step, which costs
one pass of the window's rows through its first projection and q/k/v, and everything older than
the window reaches it only through the target's features.

Two choices keep it small and cheap:
- it reuses the target's token embedding and output head (not stored), and its output is
  restricted to the ``K`` tokens the target writes most often (``vocab_ids``): the full
  49,152-row head of the default model would cost a fifth of a target step per drafted node;
- one decoder layer with a narrower MLP than the target's.

The decision model is a tiny MLP on what the head knows about a drafted node before drawing its
child (depth, the node's own draft probability, the top probabilities and entropy of the child's
distribution) that predicts the chance the child is accepted given the node is. Drafting stops
below a threshold; deciding a node's descendants from the node and its distribution never
changes the law of the node itself, so verification stays exact.

A loaded head drafts with its layer as one compiled call a depth where the CPU kernels are built
(``multispec.kernels.head_layer``: the input product, norms, products, rotation, activation and
each node's attention over its parent's path, gathered in the kernel); training and any other
device run the Python layer, which the compiled one equals within rounding.

Both are stored in one safetensors file with their shapes and the target they were trained for
in its metadata.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from multispec.models.config import ModelConfig
from multispec.models.llama import DecoderLayer, LlamaForCausalLM, Projection, apply_rope, packing_available

FORMAT = "multispec-draft-head-1"
MAX_DEPTH = 16
"""Deepest path the head's position table covers."""
DECISION_FEATURES = 6
"""depth / MAX_DEPTH, the node's draft probability, the child's top-3 probabilities, its entropy / log K."""


@dataclass(frozen=True)
class HeadConfig:
    """Shapes of a draft head and the target it belongs to."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_tokens: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-5
    target: str = ""
    """Name of the target model the head was trained for (informational)."""
    threshold: float = 0.0
    """Decision threshold recommended with the shipped decision model (0: none shipped)."""
    context: int = 1
    """Pairs (target feature, following token) the root's step reads, the root's own included
    (1: the root alone)."""

    def layer_config(self) -> ModelConfig:
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=self.num_tokens, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.hidden_size // self.num_attention_heads,
                           max_position_embeddings=self.context + MAX_DEPTH,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=10000.0, rope_scaling=None,
                           tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=None,
                           eos_token_ids=[])

    @classmethod
    def for_target(cls, target: ModelConfig, num_tokens: int, intermediate_size: int | None = None,
                   name: str = "", context: int = 1) -> HeadConfig:
        if context < 1:
            raise ValueError(f"a draft head's context must be at least 1 (the root), got {context}")
        return cls(hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=target.num_key_value_heads,
                   intermediate_size=intermediate_size or max(64, target.intermediate_size // 2),
                   num_tokens=num_tokens, target_vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                   target=name, context=context)


class PathAttention:
    """Attention of each drafted node over its own path: keys and values of the root's window and
    of its ancestors (kept here between depths, gathered by parent) and its own. ``attend`` is the
    decoder layer's hook (see ``multispec.models.llama.Attention``). ``mask [N, L]`` marks the
    stored keys that exist (a window shorter than the head's context is padded on the left); None:
    all of them."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None):
        self.keys, self.values, self.mask = keys, values, mask  # [N, L, kv_heads, head_dim], [N, L]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.keys is not None:
            k = torch.cat([self.keys, k[:, None]], dim=1)
            v = torch.cat([self.values, v[:, None]], dim=1)
            if self.mask is not None:
                self.mask = F.pad(self.mask, (0, 1), value=True)
        else:
            k, v = k[:, None], v[:, None]
        self.keys, self.values = k, v
        return _attend_last(q, k, v, self.mask)

    def children(self, parents: torch.Tensor) -> PathAttention:
        """The paths of the next depth's nodes, whose parents are the rows ``parents`` of this one."""
        return PathAttention(self.keys[parents], self.values[parents], None if self.mask is None else self.mask[parents])


def _window_attention(attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n: int,
                      mask: torch.Tensor | None) -> tuple[torch.Tensor, PathAttention]:
    """The roots' step through the layer's attention over their windows: ``h [N * C, H]`` (normed,
    C pairs per root, the root's last), ``cos``/``sin`` per row. Every row gives its key and value,
    but only each root's row is queried and goes through the output product (the other rows'
    outputs would be dropped: in training they were 7/8 of the window's q and o products at C = 8).
    Returns the output product of the roots' attention ``[N, H]`` and the paths the drafted depths
    extend."""
    t = h.shape[0]
    c = t // n
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    root_cos, root_sin = cos.view(n, c, -1)[:, -1], sin.view(n, c, -1)[:, -1]
    if attn.fused:  # one product for q/k/v; the roots' queries are sliced from it
        qkv = attn.qkv(h).view(t, heads + 2 * kv_heads, d)
        k = apply_rope(qkv[:, heads:heads + kv_heads], cos, sin)
        v = qkv[:, heads + kv_heads:]
        q = apply_rope(qkv.view(n, c, heads + 2 * kv_heads, d)[:, -1, :heads], root_cos, root_sin)
        output = attn.o
    else:
        k = apply_rope(attn.k_proj(h).view(t, kv_heads, d), cos, sin)
        v = attn.v_proj(h).view(t, kv_heads, d)
        q = apply_rope(attn.q_proj(h.view(n, c, -1)[:, -1]).view(n, heads, d), root_cos, root_sin)
        output = attn.o_proj
    k, v = k.view(n, c, kv_heads, d), v.view(n, c, kv_heads, d)
    return output(_attend_last(q, k, v, mask).reshape(n, heads * d)), PathAttention(k, v, mask)


class CompiledPath:
    """The paths of a depth's nodes for the compiled head layer (``DraftHead.step`` on a
    ``multispec.kernels.head_layer``): the keys and values ``[P, L, kv_heads, D]`` of the paths of
    the previous call's rows, which of them each node continues (``parents``; None: row i
    continues path i), the roots' window mask (``[N, C]``, None: every pair exists) and each
    node's root in it. The kernel gathers each node's parent path as it extends it, so a depth
    costs no gather here."""

    __slots__ = ("keys", "values", "parents", "mask", "roots")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, parents: torch.Tensor | None,
                 mask: torch.Tensor | None, roots: torch.Tensor | None):
        self.keys, self.values, self.parents, self.mask, self.roots = keys, values, parents, mask, roots

    def children(self, parents: torch.Tensor) -> CompiledPath:
        """The paths of the next depth's nodes, whose parents are the rows ``parents`` of this one."""
        roots = None if self.mask is None else self.roots[parents]
        return CompiledPath(self.keys, self.values, parents, self.mask, roots)


def _attend_last(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q ``[N, heads, D]`` of one row per path over its keys ``[N, L, kv_heads, D]`` (GQA)."""
    groups = q.shape[1] // k.shape[2]
    out = F.scaled_dot_product_attention(q[:, :, None], k.repeat_interleave(groups, 2).transpose(1, 2),
                                         v.repeat_interleave(groups, 2).transpose(1, 2),
                                         attn_mask=None if mask is None else mask[:, None, None, :])
    return out[:, :, 0]


class DraftHead(nn.Module):
    """``step(features, tokens, attention) -> next features``; ``logits(features)`` over ``vocab_ids``."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config.layer_config(), 0)
        self.register_buffer("vocab_ids", torch.zeros(config.num_tokens, dtype=torch.long))
        self.decision = nn.Sequential(nn.Linear(DECISION_FEATURES, 32), nn.SiLU(), nn.Linear(32, 1))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, config.hidden_size // config.num_attention_heads, 2).float()
                                      / (config.hidden_size // config.num_attention_heads)))
        # Positions: the window's pairs at 0 .. context - 1 (the root's last), drafted depth d at
        # context - 1 + d.
        angles = torch.outer(torch.arange(config.context + MAX_DEPTH, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        # The target's token embedding and its output rows of vocab_ids ([K, H]): plain tensors,
        # neither parameters nor saved.
        self.embedding: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        # Loaded for inference on a CPU whose matrix library packs weights: fc, the layer's
        # products and the output rows run packed (see ``multispec.models.llama.Projection``).
        self.packed = False
        self.fc_product: Projection | None = None
        self.output_product: Projection | None = None
        self._layer_call = None
        """(op, weights, rope tables) of the compiled layer once looked up (see ``_compiled``);
        False where the layer runs in Python."""

    def attach(self, target: LlamaForCausalLM) -> DraftHead:
        """Share the target's embedding and take its output rows of ``vocab_ids`` (not stored)."""
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError(f"draft head hidden size {self.config.hidden_size} does not match the target's "
                             f"{target.config.hidden_size}")
        if target.config.vocab_size != self.config.target_vocab_size:
            raise ValueError(f"draft head was trained for a vocabulary of {self.config.target_vocab_size} tokens, "
                             f"the target has {target.config.vocab_size}")
        self.embedding = target.model.embed_tokens.weight.detach()
        self.output = target.output_weight().detach()[self.vocab_ids].to(self.fc.weight.dtype)
        if self.packed:
            self.output_product = Projection(self.output, None, pack=True)
        return self

    def _inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        dtype = self.fc.weight.dtype
        x = torch.cat([features.to(dtype), F.embedding(tokens, self.embedding).to(dtype)], -1)
        return self.fc_product(x) if self.fc_product is not None else self.fc(x)

    def _rope(self, positions: torch.Tensor | int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(positions, int):
            return (self.rope_cos[positions].to(dtype).expand(rows, -1),
                    self.rope_sin[positions].to(dtype).expand(rows, -1))
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def _compiled(self):
        """(op, weights, (cos, sin)) where this head's layer runs as one compiled call a depth
        (``multispec.kernels.head_layer``): a loaded head (fused products) in float32 or bf16 on the
        CPU, the target's embedding in the head's dtype, no gradients, the kernels built; else None."""
        if torch.is_grad_enabled() or self.embedding is None:
            return None
        if self._layer_call is None:
            from multispec import kernels

            attn, mlp = self.layer.self_attn, self.layer.mlp
            dtype = self.fc.weight.dtype
            op = kernels.head_layer() if (attn.fused and mlp.fused and self.vocab_ids.device.type == "cpu"
                                          and dtype in (torch.float32, torch.bfloat16)
                                          and self.embedding.dtype == dtype and self.embedding.is_contiguous()) else None
            products = (attn.qkv, attn.o, mlp.gate_up, mlp.down) if op is not None else ()
            if op is None or any(p.bias is not None for p in products):
                self._layer_call = False
                return None
            fc = self.fc_product
            streams = [fc.stream if fc is not None else None] + [p.stream for p in products]
            weights = (fc.weight if fc is not None else self.fc.weight, self.layer.input_layernorm.weight,
                       self.layer.post_attention_layernorm.weight, *(p.weight for p in products),
                       bool(self.packed), streams if all(s is not None for s in streams) else [])
            self._layer_call = (op, weights, (self.rope_cos.to(dtype), self.rope_sin.to(dtype)))
        return self._layer_call or None

    def _layer_rows(self, call, features: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    group: int, path: CompiledPath | None, mask: torch.Tensor | None,
                    roots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from multispec.models.llama import stream_rows

        op, weights, _ = call
        config = self.config
        dim = config.hidden_size // config.num_attention_heads
        dtype = self.fc.weight.dtype
        features = features.to(dtype).contiguous()
        if path is None:
            past_k = past_v = features.new_empty(0, 0, config.num_key_value_heads, dim)
            parents = tokens.new_empty(0)
        else:
            past_k, past_v = path.keys, path.values
            parents = path.parents if path.parents is not None else torch.arange(
                features.shape[0] // group, device=features.device)
        if mask is None:
            mask, roots, window = features.new_empty(0, 0, dtype=torch.bool), tokens.new_empty(0), 0
        else:
            window = mask.shape[1]
        return op(features, self.embedding, tokens.contiguous(), *weights,
                  stream_rows(), config.num_attention_heads, config.num_key_value_heads, float(config.rms_norm_eps),
                  cos, sin, group, past_k, past_v, parents, mask, roots, window, 1.0 / math.sqrt(dim))

    def step(self, features: torch.Tensor, tokens: torch.Tensor, depth: int, attention) -> torch.Tensor:
        """Predicted target features after ``tokens`` (each following the feature beside it),
        for nodes at path position ``depth`` (0: the root, with no window before it; see
        ``start``)."""
        if isinstance(attention, CompiledPath):
            call = self._compiled()
            cos, sin = call[2]
            position = self.config.context - 1 + depth
            rows = features.shape[0]
            out, attention.keys, attention.values = self._layer_rows(
                call, features, tokens, cos[position].expand(rows, -1), sin[position].expand(rows, -1), 1,
                attention, attention.mask, attention.roots)
            attention.parents = None
            return out
        x = self._inputs(features, tokens)
        cos, sin = self._rope(self.config.context - 1 + depth, x.shape[0], x.dtype)
        return self.layer(x, cos, sin, attention)

    def start(self, features: torch.Tensor, tokens: torch.Tensor,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, PathAttention]:
        """The roots' step over their windows: ``features [N, C, H]`` and ``tokens [N, C]`` are
        each root's last C pairs (C <= context, the root's own last), ``mask [N, C]`` which of
        them exist (None: all). Returns the roots' predicted features ``[N, H]`` and the attention
        the drafted depths extend."""
        n, c = tokens.shape
        if c > self.config.context:
            raise ValueError(f"a window of {c} pairs is longer than the head's context {self.config.context}")
        if mask is not None and bool(mask.all()):
            mask = None  # checked once here, not at every depth that extends the paths
        call = self._compiled()
        if call is not None:
            cos, sin = call[2]
            first = self.config.context - c
            roots = None if mask is None else torch.arange(n, device=tokens.device)
            out, keys, values = self._layer_rows(
                call, features.reshape(n * c, -1), tokens.reshape(-1), cos[first:first + c].repeat(n, 1),
                sin[first:first + c].repeat(n, 1), c, None, mask, roots)
            return out, CompiledPath(keys, values, None, None if mask is None else mask.contiguous(), roots)
        layer = self.layer
        x = self._inputs(features.reshape(n * c, -1), tokens.reshape(-1))
        positions = torch.arange(self.config.context - c, self.config.context, device=x.device).repeat(n)
        cos, sin = self._rope(positions, n * c, x.dtype)
        attended, path = _window_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, n, mask)
        # Only the roots' rows go on (the others gave their keys and values).
        root = x.view(n, c, -1)[:, -1] + attended
        return root + layer.mlp(layer.post_attention_layernorm(root)), path

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Training: ``features [R, C, H]`` and ``tokens [R, C + S - 1]``: each row's window of C
        pairs (feature at a position, the token after it; ``mask [R, C]`` which exist), then the
        S - 1 tokens after the root's; the head's own predictions fed back S times, each step
        attending to the window and the steps before it, exactly as a drafted chain runs. Returns
        the predicted features ``[R, S, H]``."""
        c = features.shape[1]
        feature, attention = self.start(features, tokens[:, :c], mask)
        out = [feature]
        for s in range(1, tokens.shape[1] - c + 1):
            feature = self.step(feature, tokens[:, c - 1 + s], s, attention)
            out.append(feature)
        return torch.stack(out, 1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over ``vocab_ids`` (float32)."""
        if self.output_product is not None:
            return self.output_product(features.to(self.output.dtype)).float()
        return F.linear(features.to(self.output.dtype), self.output).float()

    def decide(self, stats: torch.Tensor) -> torch.Tensor:
        """Predicted chance that a node's child is accepted given the node is (see ``decision_stats``)."""
        return torch.sigmoid(self.decision(stats.to(self.decision[0].weight.dtype)).squeeze(-1).float())

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() and not k.startswith("decision") else v)
                   for k, v in tensors.items()}
        save_file(tensors, str(path), metadata={"format": FORMAT, "config": json.dumps(asdict(self.config))})

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DraftHead:
        """Read a head file; a ValueError says what is wrong with one that is not a draft head."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(f"draft head not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as error:  # noqa: BLE001 - any unreadable file gets the same clear message
            raise ValueError(f"{path} is not a safetensors file: {error}") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a multispec draft head (metadata format {meta.get('format')!r}, "
                             f"expected {FORMAT!r})")
        config = HeadConfig(**json.loads(meta["config"]))
        head = cls(config)
        missing = sorted(set(head.state_dict()) - set(tensors))
        if missing:
            raise ValueError(f"{path} lacks draft head tensors: {missing[:5]}")
        try:
            head.load_state_dict(tensors, strict=True)
        except RuntimeError as error:
            raise ValueError(f"{path} does not match its own shapes: {str(error).splitlines()[0]}") from None
        head.decision.float()
        floats = [p for n, p in head.named_parameters() if not n.startswith("decision")]
        for p in floats:
            p.data = p.data.to(dtype)
        head = head.to(device).eval()
        # One matrix product for q/k/v and one for gate/up, as the target's; packed where the
        # CPU's library can (a loaded head only drafts, it is never trained further).
        head.packed = packing_available(dtype, device)
        head.layer.self_attn.fuse(head.packed)
        head.layer.mlp.fuse(head.packed)
        if head.packed:
            head.fc_product = Projection(head.fc.weight.detach(), None, pack=True)
        return head


def decision_stats(depth: torch.Tensor, node_prob: torch.Tensor, child_probs: torch.Tensor) -> torch.Tensor:
    """The decision model's input for nodes at ``depth`` drawn with probability ``node_prob`` whose
    child would be drawn from ``child_probs [N, K]``."""
    top = child_probs.topk(min(3, child_probs.shape[-1]), dim=-1).values
    if top.shape[-1] < 3:
        top = F.pad(top, (0, 3 - top.shape[-1]))
    entropy = -(child_probs * child_probs.clamp_min(1e-12).log()).sum(-1) / math.log(max(2, child_probs.shape[-1]))
    return torch.stack([depth.float() / MAX_DEPTH, node_prob.float(), top[:, 0], top[:, 1], top[:, 2], entropy], -1)
