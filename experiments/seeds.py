"""Do seeded samples depend on what shares their batch, on admission order or on speculation?

The cases that showed they did before randomness was keyed by position, rerun at full size on the
default model in float32: GSM8K test question 715 (n = 32, T 0.7, 64 tokens, seed 1005) alone twice
and batched with question 711; eight questions x 32 in one call with room for all and through an
engine whose cache admits them one at a time; four questions x 16 (256 tokens) with the default
speculation twice against plain sampling. Prints, per comparison, how many samples are identical
and, for any that are not, how close the random number that decided the first differing position
lies to a boundary of the cumulative distribution (a float32 near-tie is the only expected cause).

    python experiments/seeds.py        # about 8 minutes on 2 CPU cores
"""

from __future__ import annotations

import torch

from multispec import LLM, SamplingParams, SpecConfig
from multispec.engine import EngineConfig, LLMEngine
from multispec.reasoning import load_gsm8k
from multispec.verify.sampling import TOKEN, PositionKeys, sample_key


def compare(llm, name: str, got, want, seed: int, temperature: float) -> None:
    same = total = 0
    gaps = []
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            total += 1
            k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            if k is None:
                same += len(a.token_ids) == len(b.token_ids)
                continue
            logits = llm.logits(w.prompt_token_ids + b.token_ids[:k])[-1]
            probs = torch.softmax(logits.double() / temperature, -1)
            cdf = probs.cumsum(0)
            u = float(PositionKeys([sample_key(seed, b.index)], [k]).at(torch.tensor([0]), 0).draw(TOKEN, 0, cdf))
            edges = [float(cdf[t]) - float(probs[t]) * s for t in (a.token_ids[k], b.token_ids[k]) for s in (0, 1)]
            gaps.append(min(abs(u - e) for e in edges))
    extra = f"; others diverge where the draw lies {', '.join(f'{g:.1e}' for g in gaps)} from a boundary" if gaps else ""
    print(f"{name}: {same} of {total} samples identical{extra}", flush=True)


def main() -> None:
    llm = LLM(dtype="float32")
    q715, q711 = (load_gsm8k(limit=1, offset=i)[0].chat() for i in (715, 711))
    params = SamplingParams(n=32, temperature=0.7, max_tokens=64, seed=1005)
    alone = llm.chat([q715], params, use_tqdm=False)
    compare(llm, "question 715 alone, twice", llm.chat([q715], params, use_tqdm=False), alone, 1005, 0.7)
    batched = llm.chat([q711, q715], [SamplingParams(n=32, temperature=0.7, max_tokens=64, seed=711), params],
                       use_tqdm=False)[1:]
    compare(llm, "question 715 batched with 711", batched, alone, 1005, 0.7)

    conversations = [p.chat() for p in load_gsm8k(limit=8, offset=700)]
    each = [SamplingParams(n=32, temperature=0.7, max_tokens=64, seed=1000 + i) for i in range(8)]
    free = llm.chat(conversations, each, use_tqdm=False)
    capped = LLMEngine(llm.model, llm.tokenizer, EngineConfig(llm.engine.config.max_model_len, int(0.12 * 2**30)))
    for i, (out, sp) in enumerate(zip(free, each)):
        capped.add_request(str(i), out.prompt_token_ids, sp)
    last = {}
    while capped.has_unfinished_requests():
        for out in capped.step():
            last[out.request_id] = out
    print(f"capped engine: {capped.stats.prefill_forwards} separate admissions")
    for i in range(8):
        compare(llm, f"8 x 32, prompt {i}: capped cache against room for all", [last[str(i)]], [free[i]], 1000 + i, 0.7)

    conversations = [p.chat() for p in load_gsm8k(limit=4)]
    params = SamplingParams(n=16, temperature=0.7, max_tokens=256, seed=0)
    plain = llm.chat(conversations, params, SpecConfig(), use_tqdm=False)
    for run in (1, 2):
        spec = llm.chat(conversations, params, SpecConfig(drafter="consensus"), use_tqdm=False)
        stats = llm.last_stats
        compare(llm, f"4 x 16, default speculation run {run} ({stats.generated_tokens} tokens, {stats.drafted_tokens} "
                     f"drafted) against plain", spec, plain, 0, 0.7)


if __name__ == "__main__":
    main()
