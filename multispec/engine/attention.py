"""Attention over the two-level KV cache: prompts at prefill, packed sample trees at decode.

A sample attends to its prompt slot and to its own slot, and the two softmax halves are merged
exactly (log-sum-exp), so n samples never copy the prompt and the prompt's keys are read once per
step for all n samples together. Sample slots in use are always ``0 .. num_active-1`` (the
scheduler keeps them packed), so the attention reads the cache in place as one strided view: no
gather of the cache per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from multispec.engine.cache import KVCache


class PrefillAttention:
    """Causal attention of whole prompts, written into their prompt slots.

    ``segments`` lists (prompt_slot, length) for each prompt packed in this forward, in the
    order their tokens are concatenated. ``starts``: where in its slot each segment begins (a
    prompt whose first positions the slot holds already: its rows attend to those too); None: 0.
    """

    def __init__(self, cache: KVCache, segments: list[tuple[int, int]], starts: list[int] | None = None):
        self.cache = cache
        self.segments = segments
        self.starts = starts or [0] * len(segments)
        # Where a segment continues what its slot holds, row i sees positions up to start + i: a
        # mask where the rows are few beside what they continue; else the fused causal kernel over
        # the whole prompt with zero rows in front (a mask makes the CPU kernel compute every
        # block, masked or not: 10.4 against 8.2 ms a layer for 747 rows continuing 3 positions,
        # float32; 1.1 against 8.2 ms for 60 rows continuing 700). Both give the same bits.
        self.masks = [None if start < length else
                      torch.ones(length, start + length, dtype=torch.bool, device=cache.k_store.device).tril(start)
                      for (_, length), start in zip(segments, self.starts)]
        # Layers with a sliding window of W positions (``ModelConfig.layer_window``): row i also sees
        # no key at or before start + i - W; a mask for the segments that reach that far.
        window = cache.config.sliding_window
        device = cache.k_store.device
        self.window_masks = [None if window is None or start + length <= window else
                             torch.ones(length, start + length, dtype=torch.bool, device=device).tril(start)
                             & ~torch.ones(length, start + length, dtype=torch.bool, device=device).tril(start - window)
                             for (_, length), start in zip(segments, self.starts)]
        self.cap = cache.config.attn_logit_softcapping
        if self.cap is not None:  # the unfused kernel below takes every segment's mask, additive, built once
            causal = [torch.ones(length, start + length, dtype=torch.bool, device=device).tril(start)
                      for (_, length), start in zip(segments, self.starts)]
            self.masks = [_additive(visible) for visible in causal]
            self.window_masks = [None if visible is None else _additive(visible) for visible in self.window_masks]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outputs = []
        begin = 0
        windowed = self.cache.config.layer_window(layer) is not None
        for (slot, length), start, mask, window_mask in zip(self.segments, self.starts, self.masks, self.window_masks):
            if windowed and window_mask is not None:
                mask = window_mask
            end = begin + length
            kk = k[begin:end].transpose(0, 1)
            vv = v[begin:end].transpose(0, 1)
            keys, values = self.cache.prompt_k[layer, slot], self.cache.prompt_v[layer, slot]
            keys[:, start:start + length] = kk
            values[:, start:start + length] = vv
            # Attention reads them back as stored (rounded, where the cache is narrower than the
            # activations), as every later step does: a prompt reads the same keys and values
            # whether it continues a cached prefix or is computed whole.
            if start or keys.dtype != q.dtype:
                kk = keys[:, :start + length].to(q.dtype)
                vv = values[:, :start + length].to(q.dtype)
            rows = q[begin:end].transpose(0, 1)
            if self.cap is not None:  # no fused kernel caps its scores: this prompt's rows, unfused
                group = rows.shape[0] // kk.shape[0]
                out, _ = _reference_kernel(rows, kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0),
                                           mask, softcap=self.cap)
                outputs.append(out.transpose(0, 1))
                begin = end
                continue
            if start and mask is None:
                rows = torch.cat([rows.new_zeros(rows.shape[0], start, rows.shape[2]), rows], 1)
            # With a batch dimension the CPU runs its fused (flash) kernel; without one, the
            # unfused reference (2-4.7x slower at 128-2048 tokens).
            out = torch.nn.functional.scaled_dot_product_attention(
                rows[None], kk[None], vv[None], attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            outputs.append(out[0, :, -length:].transpose(0, 1))
            begin = end
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


@dataclass
class StepLayout:
    """Where every packed token of a decode step lives; built once per step, used by all layers.

    Sample ``b`` (in slot ``b``) contributes ``counts[b]`` tokens: its root (the last sampled
    token, not yet cached) and its draft nodes. ``tree_mask[b, i, j]`` says new token j is an
    ancestor-or-self of new token i. ``written[b]`` is how far the sample's slot is filled; the
    new tokens are written right after it.
    """

    counts: torch.Tensor          # [B] tokens per sample this step (>= 1)
    written: torch.Tensor         # [B] cache entries already used in each sample slot
    prompt_slot: torch.Tensor     # [B] prompt slot of each sample
    prompt_len: torch.Tensor      # [B] prompt length of each sample
    tree_mask: torch.Tensor       # [B, Qmax, Qmax] bool
    slots: torch.Tensor | None = None
    """[B] the sample slot each sample lives in; None: sample b in slot b (the engine's packed
    slots, read in place)."""
    scratch: torch.Tensor | None = None
    """[B] how many of the positions right before ``written[b]`` are draft nodes of this step
    rather than the sample's text (a draft model's tree, written one depth a forward); None: none."""
    scratch_mask: torch.Tensor | None = None
    """[B, Qmax, Smax] bool: which of those draft positions (oldest first) each new token sees
    (its ancestors); the rest of the cache is seen whole."""


def split_step(batch: int, qmax: int, drafting: int, tokens: int) -> bool:
    """Whether ``DecodeAttention`` splits a step into a root part and a draft part.

    One part pads every sample to the deepest draft's rows; two parts pad only the drafting
    samples, but the second part gathers their caches and runs every attention operation once
    more per layer. Measured on a CPU (``experiments/layout.py``: 16 samples, 250 cached
    tokens), that second pass costs about what padding as many rows as the step has real ones
    does: one part was faster where half the samples drafted (one token each: 217 vs 240 ms;
    three: 281 vs 310 ms) and two parts only where a few samples drafted deep (one sample, four
    tokens: 220 vs 246 ms). So the step is split only where one part would pad more rows than the
    step has."""
    return 0 < drafting < batch and (batch - drafting) * (qmax - 1) > tokens


class DecodeAttention:
    """Attention of packed sample tokens (roots plus draft trees) over prompt and own caches.

    On a CPU where the compiled kernel is built (``multispec.kernels``), one call a layer does it
    all: it writes the new keys and values, and each (sample, kv head) attends to its prompt and
    its own keys in one float32 softmax, ragged (no padding rows, no parts), within the layer's
    sliding window where it has one (the keys before the window neither scored nor read), its
    scores capped where the model caps them (Gemma 2), and in a draft model's step only the
    earlier draft nodes each row descends from. 1.25-1.4x faster plain steps than the portable
    path below at 4 to 128 samples (docs/results.md). The portable path, for other devices and for
    a draft model's steps over its scratch positions under a sliding window:

    Attention batches a sample's query rows as a block, so samples whose drafts differ in size
    are padded to a common number of rows. Where that padding would outgrow the step (a few
    samples drafting deep, see ``split_step``), the step is split in two parts: every sample's
    root row (one row each, read in place from the cache), and the draft rows of the drafting
    samples only (their caches gathered). Otherwise one part holds all rows.

    The layout is worked out on the CPU from ``StepLayout`` (small, data-dependent tensors), and
    only the finished index and mask tensors move to the cache's device, once per step.
    """

    def __init__(self, cache: KVCache, layout: StepLayout, split: bool | None = None, compiled: bool = True):
        """``split``: force the two-part (True) or one-part (False) layout where the step has both
        drafting and plain samples; None lets ``split_step`` choose (the engine's way).
        ``compiled``: use the compiled CPU kernel where it is built (see ``multispec.kernels``);
        False keeps the portable path."""
        self.cache = cache
        counts = layout.counts
        batch, total = counts.numel(), int(counts.sum())
        self.batch, self.qmax, self.total = batch, int(counts.max()), total
        offsets = torch.cumsum(counts, 0) - counts
        device = cache.sample_k.device
        in_place = layout.slots is None
        # (A draft model's step over its scratch positions under a sliding window: the portable path.)
        scratch_window = layout.scratch is not None and cache.config.sliding_window is not None
        self.op = compiled_kernel(device) if compiled and not scratch_window else None
        self.parts: list[_Part] = []
        self.window_parts: list[_Part] | None = None
        """The portable path's parts with each row's sliding window, for the layers that have one
        (``ModelConfig.layer_window``), where some row of the step is that far into its sequence;
        None where no window excludes a key this step (every layer then runs as without one)."""
        if self.op is not None:  # the compiled kernel, which windows and caps itself
            slots = torch.arange(batch) if in_place else layout.slots
            self.op_args = tuple(t.to(device, torch.long).contiguous() for t in (
                slots, offsets, counts, layout.written, layout.prompt_slot, layout.prompt_len)) + (
                layout.tree_mask.to(device, torch.bool).contiguous(), cache.config.head_dim ** -0.5)
            self.scratch_args = (None, None)
            """A draft model's step: each sample's count of scratch positions and which of them each
            row sees (``StepLayout.scratch``, ``scratch_mask``); (None, None) in any other step."""
            if layout.scratch is not None:
                self.scratch_args = (layout.scratch.to(device, torch.long).contiguous(),
                                     layout.scratch_mask.to(device, torch.bool).contiguous())
            return
        window = cache.config.sliding_window
        windowed = window is not None and int((layout.prompt_len + layout.written + counts).max()) > window
        row_sample = torch.repeat_interleave(torch.arange(batch), counts)
        row_index = torch.arange(total) - offsets[row_sample]
        self.row_sample = (row_sample if in_place else layout.slots[row_sample]).to(device)
        self.row_cache_pos = (layout.written[row_sample] + row_index).to(device)
        drafting = torch.nonzero(counts > 1).flatten()
        if split is None:
            split = split_step(batch, self.qmax, drafting.numel(), total)
        split = split and 0 < drafting.numel() < batch

        def parts(window: int | None) -> list[_Part]:
            if split:
                return [_Part(cache, layout, offsets, torch.arange(batch), 0, 1, in_place, window),
                        _Part(cache, layout, offsets, drafting, 1, self.qmax - 1, False, window)]
            return [_Part(cache, layout, offsets, torch.arange(batch), 0, self.qmax, in_place, window)]

        every_layer = not cache.config.window_layers  # windowed, where there is a window
        if not (windowed and every_layer):
            self.parts = parts(None)
        if windowed:
            self.window_parts = parts(window)

    def kernel_args(self) -> tuple | None:
        """What the compiled layer stack (``multispec.kernels.decode_layers``) needs to run this
        step's attention itself: the caches of every layer, then the compiled attention's index
        tensors; None where the step runs the portable path. (Its scratch tensors: ``scratch_args``.)"""
        if self.op is None:
            return None
        cache = self.cache
        return (cache.sample_k, cache.sample_v, cache.prompt_k, cache.prompt_v) + self.op_args

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if self.op is not None:  # writes k and v into the sample slots itself
            return self.op(q, k, v, cache.sample_k[layer], cache.sample_v[layer], cache.prompt_k[layer],
                           cache.prompt_v[layer], *self.op_args, cache.config.layer_window(layer) or 0,
                           cache.config.attn_logit_softcapping or 0.0, *self.scratch_args)
        parts = self.parts
        if self.window_parts is not None and cache.config.layer_window(layer) is not None:
            parts = self.window_parts
        cache.sample_k[layer, self.row_sample, :, self.row_cache_pos] = k.to(cache.sample_k.dtype)
        cache.sample_v[layer, self.row_sample, :, self.row_cache_pos] = v.to(cache.sample_v.dtype)
        if len(parts) == 1:
            return parts[0].attend(layer, q)
        out = q.new_empty(q.shape)
        for part in parts:
            out[part.rows] = part.attend(layer, q)
        return out


class _Part:
    """Query rows ``first .. first + width - 1`` of each of some samples, attended as one batch.

    Rows past a sample's own count are padding: they see key 0 only (a finite softmax) and are
    dropped. ``contiguous``: the members are samples 0..B-1 in slots 0..B-1, whose caches are
    read in place; otherwise their slots are gathered. ``window``: each row sees only the keys of
    the last ``window`` positions up to its own (a sliding window); None: every key before it.

    A row's position is its sample's prompt and text before the step, plus its depth in the
    step's tree (and its draft-model ancestors among the scratch positions); a key of the text at
    slot index j is at the prompt's length + j. A draft node's scratch positions are its
    ancestors, nearer than any window the tree fits in: they stay seen.
    """

    def __init__(self, cache: KVCache, layout: StepLayout, offsets: torch.Tensor, members: torch.Tensor,
                 first: int, width: int, contiguous: bool, window: int | None = None):
        self.cache = cache
        self.contiguous = contiguous
        self.members = members
        self.member_slots = members if layout.slots is None else layout.slots[members]
        size = members.numel()
        self.size, self.width = size, width
        counts = layout.counts[members]
        written = layout.written[members]
        # Which (member, row) pairs are real, and where they sit in the packed step.
        index = torch.arange(width)[None, :] + first
        real = index < counts[:, None]
        self.member_of, self.index_of = torch.nonzero(real, as_tuple=True)
        self.rows = offsets[members][self.member_of] + first + self.index_of
        self.full = bool(real.all())  # no padding rows
        # Rows are exactly 0..T-1 in order: the part holds every row of the step, unpadded.
        self.dense = self.full and contiguous and first == 0 and int(counts.sum()) == size * width
        self.key_len = int((written + counts).max())

        # Own-cache mask: every cached key, plus the new tokens that are ancestors-or-self.
        key_pos = torch.arange(self.key_len)
        rel = key_pos[None, :] - written[:, None]                           # [P, K]
        old = rel < 0
        new = (rel >= 0) & (rel < counts[:, None])
        rel_clamped = rel.clamp(0, layout.tree_mask.shape[1] - 1)
        tree = layout.tree_mask[members][:, first: first + width]           # [P, W, Qmax]
        tree = torch.gather(tree, 2, rel_clamped[:, None, :].expand(size, width, self.key_len))
        seen_old = old[:, None, :]
        in_scratch = torch.zeros_like(old)
        if layout.scratch is not None:  # this step's earlier draft nodes: only the ancestors
            drafted = rel + layout.scratch[members][:, None]                # index among them
            in_scratch = old & (drafted >= 0)
            ancestors = layout.scratch_mask[members][:, first: first + width]  # [P, W, Smax]
            ancestors = torch.gather(ancestors, 2, drafted.clamp(0, ancestors.shape[2] - 1)[:, None, :].expand(
                size, width, self.key_len))
            seen_old = seen_old & (~in_scratch[:, None, :] | ancestors)
        prompt_len = layout.prompt_len[members]
        if window is not None:
            depth = layout.tree_mask[members].sum(-1) - 1                   # [P, Qmax] each node's depth
            row_depth = depth[:, first: first + width]                     # [P, W]
            position = prompt_len[:, None] + written[:, None] + row_depth  # [P, W] each row's position
            if layout.scratch is not None:
                position += layout.scratch_mask[members][:, first: first + width].sum(-1) - layout.scratch[members][
                    :, None]
            # Lowest position each row sees; the text's keys at the prompt's length + j, the step's
            # nodes at the row's position less their difference in depth.
            lowest = position - window + 1
            near_text = (prompt_len[:, None] + key_pos[None, :])[:, None, :] >= lowest[:, :, None]
            seen_old = seen_old & (near_text | in_scratch[:, None, :])
            key_depth = torch.gather(depth, 1, rel_clamped)                # [P, K]
            tree = tree & (row_depth[:, :, None] - key_depth[:, None, :] < window)
        visible = seen_old | (new[:, None, :] & tree)                       # [P, W, K]
        visible[:, :, 0] |= ~real
        # As an additive mask [P, 1, G*W, K], rows in the order attend lays queries out (query
        # head within its kv group, then draft row); none where every key is visible.
        self.own_mask = None
        device = cache.sample_k.device
        cap = cache.config.attn_logit_softcapping
        # One attention call over prompt and own keys (below); not with capped scores, which only the
        # reference kernel computes.
        self.concat = concat_keys(device) and cap is None
        group = cache.config.num_attention_heads // cache.config.num_key_value_heads
        seen_all = bool(visible.all())
        if not seen_all or self.concat:
            own_visible = visible[:, None].expand(size, group, width, self.key_len).reshape(size, 1, group * width, -1)
        if not seen_all and not self.concat:
            self.own_mask = torch.zeros(own_visible.shape, dtype=cache.compute_dtype)
            self.own_mask.masked_fill_(~own_visible, float("-inf"))

        # Members grouped by prompt slot: each prompt's keys are read once for all its samples.
        # Queries are laid out [prompt, member, ...] (padded to the largest group) so every
        # prompt is handled by one batched matmul, however many prompts share the step.
        slots = layout.prompt_slot[members].tolist()
        lengths = layout.prompt_len[members].tolist()
        distinct = sorted(set(slots))
        group_of = {slot: g for g, slot in enumerate(distinct)}
        member = [0] * size
        seen = [0] * len(distinct)
        for b, slot in enumerate(slots):
            member[b] = seen[group_of[slot]]
            seen[group_of[slot]] += 1
        self.num_groups, self.group_size = len(distinct), max(seen)
        self.sample_group = torch.tensor([group_of[slot] for slot in slots])
        self.sample_member = torch.tensor(member)
        self.group_slots = torch.tensor(distinct)
        self.prompt_len = max(lengths)
        length_of = {slot: length for slot, length in zip(slots, lengths)}
        pad = torch.arange(self.prompt_len)[None, :] >= torch.tensor([length_of[s] for s in distinct])[:, None]
        self.prompt_mask = None
        if bool(pad.any()):
            self.prompt_mask = torch.zeros(len(distinct), 1, 1, self.prompt_len, dtype=cache.compute_dtype)
            self.prompt_mask.masked_fill_(pad[:, None, None, :], float("-inf"))
        # One prompt for all members, or one member per prompt: queries already have the
        # prompt-major layout, so no scatter or gather is needed.
        self.single = len(distinct) == 1
        self.single_slot = distinct[0]
        self.one_each = not self.single and self.group_size == 1
        if self.one_each:
            self.group_slots = torch.tensor(slots)
            if self.prompt_mask is not None:
                self.prompt_mask = self.prompt_mask[self.sample_group]
        # Each member's rows against its prompt's keys [P, G*W, plen]: per row where a window applies.
        prompt_visible = (torch.arange(self.prompt_len)[None, :] < prompt_len[:, None])[:, None, :]
        self.prompt_dead = None
        if window is not None:
            prompt_visible = prompt_visible & (torch.arange(self.prompt_len)[None, None, :] >= lowest[:, :, None])
            prompt_visible = prompt_visible[:, None].expand(size, group, width, -1).reshape(size, group * width, -1)
            # A row whose window starts past its prompt sees none of it: in the halves, that half
            # gets no weight (its log-sum-exp taken as -inf), computed over key 0 to stay finite.
            dead = ~prompt_visible.any(-1)                                   # [P, G*W]
            if bool(dead.any()):
                self.prompt_dead = torch.zeros(size, 1, group * width, 1).masked_fill_(dead[:, None, :, None],
                                                                                     float("-inf"))
            halves_visible = prompt_visible.clone()
            halves_visible[:, :, 0] |= dead
            self.prompt_mask = _additive(self._prompt_rows(halves_visible), cache.compute_dtype)[:, None]
        # Off the CPU: each member's prompt and own keys as one sequence, one fused attention call
        # a layer (see ``concat_keys``), under one boolean mask [P, 1, G*W, prompt + own keys].
        self.member_prompt = self.concat_mask = None
        if self.concat:
            self.member_prompt = torch.tensor(slots)
            mask = torch.cat((prompt_visible[:, None].expand(size, 1, group * width, self.prompt_len),
                              own_visible), dim=-1)
            self.concat_mask = None if bool(mask.all()) else mask
            self.prompt_mask = self.prompt_dead = None  # the halves are not run
        for name in ("members", "member_slots", "member_of", "index_of", "rows", "sample_group", "sample_member",
                     "group_slots", "prompt_mask", "prompt_dead", "own_mask", "member_prompt", "concat_mask"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        self.kernel = kernel_for(device) if cap is None else partial(_reference_kernel, softcap=cap)

    def _prompt_rows(self, visible: torch.Tensor) -> torch.Tensor:
        """Each member's rows' view of its prompt ``visible [P, G*W, plen]`` laid out as the
        prompt half lays out its queries: [1, members * G*W, plen] for one prompt, [P, G*W, plen]
        for one member per prompt, else [prompts, group size * G*W, plen] (a padding member sees
        every key read, zeros or keys: a finite softmax)."""
        if self.single:
            return visible.reshape(1, -1, visible.shape[-1])
        if self.one_each:
            return visible
        rows = visible.shape[1]
        grouped = torch.ones(self.num_groups, self.group_size, rows, visible.shape[-1], dtype=torch.bool)
        grouped[self.sample_group, self.sample_member] = visible
        return grouped.reshape(self.num_groups, self.group_size * rows, -1)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention output of this part's real rows, in the order of ``rows``."""
        cache = self.cache
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = cache.sample_k.shape[2]
        group = heads // kv_heads
        size, width = self.size, self.width
        rows = group * width
        if self.dense:
            q_pad = q.view(size, width, heads, dim)
        elif self.full:
            q_pad = q[self.rows].view(size, width, heads, dim)
        else:
            q_pad = q.new_zeros(size, width, heads, dim)
            q_pad[self.member_of, self.index_of] = q[self.rows]
        # [P, kv_heads, group * W, D]: query heads that share a kv head become extra rows.
        q_rows = q_pad.view(size, width, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(
            size, kv_heads, rows, dim)

        if self.contiguous:
            own_k = cache.sample_k[layer, :size, :, : self.key_len]
            own_v = cache.sample_v[layer, :size, :, : self.key_len]
        else:
            own_k = cache.sample_k[layer, :, :, : self.key_len].index_select(0, self.member_slots)
            own_v = cache.sample_v[layer, :, :, : self.key_len].index_select(0, self.member_slots)
        if own_k.dtype != q.dtype:  # a cache narrower than the activations, read back exactly
            own_k, own_v = own_k.to(q.dtype), own_v.to(q.dtype)
        if self.concat:
            out = self._concatenated(layer, q_rows, own_k, own_v)
        else:
            out = self._halves(layer, q_rows, own_k, own_v)
        out = out.view(size, kv_heads, group, width, dim).permute(0, 3, 1, 2, 4).reshape(size, width, heads, dim)
        return out.reshape(size * width, heads, dim) if self.full else out[self.member_of, self.index_of]

    def _concatenated(self, layer: int, q_rows: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor) -> torch.Tensor:
        """[P, kvh, G*W, D]: every member's rows against its prompt's keys and its own, concatenated."""
        cache, plen = self.cache, self.prompt_len
        if self.single:
            slot, size = self.single_slot, self.size
            pk = cache.prompt_k[layer, slot: slot + 1, :, :plen].expand(size, -1, -1, -1)
            pv = cache.prompt_v[layer, slot: slot + 1, :, :plen].expand(size, -1, -1, -1)
        else:
            pk = cache.prompt_k[layer, :, :, :plen].index_select(0, self.member_prompt)
            pv = cache.prompt_v[layer, :, :, :plen].index_select(0, self.member_prompt)
        pk, pv = pk.to(q_rows.dtype), pv.to(q_rows.dtype)
        return torch.nn.functional.scaled_dot_product_attention(
            q_rows, torch.cat((pk, own_k), 2), torch.cat((pv, own_v), 2), attn_mask=self.concat_mask,
            scale=q_rows.shape[-1] ** -0.5)

    def _halves(self, layer: int, q_rows: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor) -> torch.Tensor:
        """[P, kvh, G*W, D]: the prompt and own halves, each a softmax, merged by their log-sum-exp."""
        cache = self.cache
        size, rows, dim = self.size, q_rows.shape[2], q_rows.shape[3]
        kv_heads = q_rows.shape[1]
        own_out, own_lse = self.kernel(q_rows, own_k, own_v, self.own_mask)    # [P, kvh, G*W, D], [P, kvh, G*W]

        # Prompt half: [prompts, kvh, members * G*W, D] against each prompt's keys.
        plen = self.prompt_len
        if self.single:
            slot = self.single_slot
            pk = cache.prompt_k[layer, slot: slot + 1, :, :plen]
            pv = cache.prompt_v[layer, slot: slot + 1, :, :plen]
            qg = q_rows.transpose(0, 1).reshape(1, kv_heads, size * rows, dim)
        elif self.one_each:
            pk = cache.prompt_k[layer, self.group_slots, :, :plen]
            pv = cache.prompt_v[layer, self.group_slots, :, :plen]
            qg = q_rows
        else:
            pk = cache.prompt_k[layer, self.group_slots, :, :plen]
            pv = cache.prompt_v[layer, self.group_slots, :, :plen]
            qg = q_rows.new_zeros(self.num_groups, self.group_size, kv_heads, rows, dim)
            qg[self.sample_group, self.sample_member] = q_rows
            qg = qg.transpose(1, 2).reshape(self.num_groups, kv_heads, self.group_size * rows, dim)
        pre_out, pre_lse = self.kernel(qg, pk.to(qg.dtype), pv.to(qg.dtype), self.prompt_mask)

        def per_member(x):
            if self.one_each:
                return x
            x = x.view(x.shape[0], kv_heads, -1, rows, x.shape[-1]).transpose(1, 2)  # [G, m, kvh, G*W, .]
            if self.single:
                return x[0]
            return x[self.sample_group, self.sample_member]

        pre_out, pre_lse = per_member(pre_out), per_member(pre_lse[..., None])
        if self.prompt_dead is not None:  # rows whose window holds none of the prompt
            pre_lse = pre_lse + self.prompt_dead
        # The two softmax halves merged exactly: each half weighted by its share of the total mass.
        share = torch.sigmoid(pre_lse - own_lse[..., None]).to(own_out.dtype)
        return torch.lerp(own_out, pre_out, share)


def _additive(visible: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean mask as an additive one: 0 where seen, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Softmax attention and the log-sum-exp of each row's scores (float32), in one fused kernel."""
    return _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=q.shape[-1] ** -0.5)


def _reference_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      softcap: float | None = None):
    """The same from batched matrix products and a float32 softmax (devices without the fused
    kernel, the tests, and scores soft-capped as Gemma 2's: ``softcap * tanh(score / softcap)``)."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(q.shape[-1] ** -0.5)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        scores.add_(mask)
    top = scores.amax(-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights.div_(total).to(v.dtype), v)
    return out, (top + total.log()).squeeze(-1)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def concat_keys(device: torch.device) -> bool:
    """Whether the portable attention reads each sample's prompt keys and own keys as one
    concatenated sequence, in one ``scaled_dot_product_attention`` call a layer, instead of two
    softmax halves merged by their log-sum-exp (about a dozen operations each). Off the CPU: a
    decode step on a GPU is bound by dispatching its operations (docs/results.md, "On a GPU"), and
    copying a prompt's keys for each of its samples costs little there. On a CPU the halves read a
    prompt's keys once for all its samples, which is what counts there."""
    return device.type != "cpu"


def compiled_kernel(device: torch.device):
    """The compiled decode attention (``multispec.kernels``) for a CPU cache, where it is built."""
    if device.type != "cpu":
        return None
    from multispec import kernels

    return kernels.decode_attention()


def kernel_for(device: torch.device):
    """The fused kernel where the device has one that returns the log-sum-exp (CPU), else the
    reference. The merge of the prompt and own halves needs each half's log-sum-exp, which the
    public ``scaled_dot_product_attention`` does not return.

    Batched products instead of the fused kernel were tried for the own half on the CPU, whose
    fused kernel has a fixed cost per (sample, kv head) matrix: on contiguous keys they ran 2.5x
    faster at 128 samples in bf16, but a sample's cached keys are a strided view of its slot, which
    the CPU's batched product copies first: with the copies a step of 128 samples spent 68 ms in
    attention against 80 fused, at the price of bf16-rounded scores, and at 4 samples the fused
    kernel was the faster one even on contiguous keys. Not taken."""
    if device.type == "cpu" and _FLASH_CPU is not None:
        return _fused_kernel
    return _reference_kernel
