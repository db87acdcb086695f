"""Tiny checkpoints for end-to-end tests that need many samples: a forward costs microseconds.

The successor model is a random two-layer Llama whose output head points each token a at two
fixed successors: after a, s(a) is usually the likeliest token (0.5 to 0.95 at temperature 1,
as the random layers mix in some context) and a second successor r(a) the next, with the rest
spread over the vocabulary. s is a permutation with one short cycle (``CYCLE`` tokens), so a prompt that runs around
it holds the continuation the model most likely writes next, and siblings hold each other's:
drafts are often accepted, as with a real model on repetitive text, while every position keeps
a real alternative, so the law of a few tokens has many well-filled cells for distribution tests.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.models.conftest import write_tiny_tokenizer

VOCAB = 400
CYCLE = 8


def write_successor_model(directory: Path, seed: int = 0, logits: tuple[float, float] = (10.0, 9.0)) -> list[int]:
    """Save the successor model (transformers layout, with the tiny tokenizer) into ``directory``;
    returns s as a list (s[a] = successor of a; ``cycle_start`` finds the short cycle). ``logits``:
    those of s(a) and r(a) after a; every other token's is about N(0, 1.7)."""
    import transformers

    generator = torch.Generator().manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    order = torch.randperm(VOCAB, generator=generator)
    cycle, rest = order[:CYCLE], order[CYCLE:]
    successor = torch.empty(VOCAB, dtype=torch.long)
    successor[cycle] = cycle.roll(-1)
    successor[rest] = rest.roll(-1)
    embedding = torch.randn(VOCAB, config.hidden_size, generator=generator)
    second = torch.randperm(VOCAB, generator=generator)
    # The final RMSNorm scales e_a to length sqrt(hidden); a head row of length L/sqrt(hidden) along
    # e_a then gives a's successor the logit L * cos(e_a, e_a) = L, other tokens L * cos ~ N(0, L^2/hidden).
    unit = embedding / embedding.norm(dim=1, keepdim=True) / config.hidden_size ** 0.5
    head = torch.zeros_like(embedding)
    head[successor] += logits[0] * unit
    head[second] += logits[1] * unit
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embedding)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return successor.tolist()


def chain(successor: list[int], start: int, length: int) -> list[int]:
    """``length`` tokens of the successor chain from ``start``."""
    out = [start]
    while len(out) < length:
        out.append(successor[out[-1]])
    return out


def cycle_start(successor: list[int]) -> int:
    """A token on the short cycle."""
    start = 0
    for token in range(len(successor)):
        if len(set(chain(successor, token, CYCLE + 1))) == CYCLE:
            return token
    return start


def write_copy_head(path: Path, llm, vocab_ids: list[int] | None = None, seed: int = 0) -> list[int]:
    """A draft head for a tiny model whose decoder layer passes its input through and whose input
    is the drafted token's embedding: its q after token a is the output head applied to a's
    embedding, close to the successor model's own law after a (the model's layers only mix in some
    context), so drafts are often but not always accepted. ``vocab_ids``: the tokens it may draft
    (default all). Returns them."""
    from multispec.models.draft_head import DraftHead, HeadConfig

    config = llm.model.config
    ids = list(range(config.vocab_size)) if vocab_ids is None else list(vocab_ids)
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(config, len(ids), intermediate_size=32, name="tiny"))
    hidden = config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
        head.vocab_ids.copy_(torch.tensor(ids))
    head.save(path)
    return ids
