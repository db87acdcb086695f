"""What drafts cost a decode step of B samples, by which samples draft: the forward alone (the
layers and the output head, as the engine runs them), B samples after 128 generated tokens of one
GSM8K question, with no drafts, one draft token for one, two or four samples, three for one, and
one for every sample; median of 15 interleaved repeats. Written up in docs/results.md (the live
correction of drafting steps).

    python experiments/draft_shape.py            # 16 samples
    python experiments/draft_shape.py 64
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> None:
    from multispec import LLM, SamplingParams
    from multispec.drafters import DraftTree
    from multispec.engine.attention import DecodeAttention
    from multispec.engine.step import pack
    from multispec.reasoning import load_gsm8k

    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    llm = LLM()
    engine, tokenizer = llm.engine, llm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(load_gsm8k(limit=1)[0].chat()), add_special_tokens=False)
    engine.add_request("p", prompt, SamplingParams(n=batch, temperature=0.7, max_tokens=300, ignore_eos=True, seed=0))
    for _ in range(128):
        engine.step()
    slots = engine.scheduler.slots

    def chain(length: int) -> DraftTree:
        return DraftTree([5] * length, list(range(-1, length - 1)), None) if length else DraftTree.EMPTY

    shapes = {"no drafts": [0] * batch, "1 sample x 1": [1] + [0] * (batch - 1),
              "2 samples x 1": [1, 1] + [0] * (batch - 2), "4 samples x 1": [1] * 4 + [0] * (batch - 4),
              "1 sample x 3": [3] + [0] * (batch - 1), "all x 1": [1] * batch}
    times: dict[str, list[float]] = {name: [] for name in shapes}
    parts: dict[str, int] = {}
    with torch.inference_mode():
        for _ in range(15):
            for name, lengths in shapes.items():
                step = pack(slots, [chain(k) for k in lengths], engine.device)
                start = time.perf_counter()
                attention = DecodeAttention(engine.cache, step.layout)
                engine.model.logits(engine.model.hidden_states(step.token_ids, step.positions, attention))
                times[name].append(time.perf_counter() - start)
                parts[name] = len(attention.parts)
    base = statistics.median(times["no drafts"])
    print(f"{batch} samples, {llm.dtype}; forward of the step, median of 15\n")
    print("| drafts | attention parts | ms | against no drafts |")
    print("|---|---|---|---|")
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"| {name} | {parts[name]} | {1e3 * median:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
