"""Prompt caching on and off, on workloads whose prompts begin alike.

- ``fewshot``: 16 GSM8K test questions behind the same 8 worked examples from the train set (the
  harnesses' few-shot prompt), one ``generate`` call, n = 4 samples each, temperature 0.7: the
  first prompt computes the examples and the other 15 continue it.
- ``chat``: 4 conversations of 6 turns (GSM8K questions asked in a row, each answer kept), one
  ``generate`` call a turn for all four, n = 1: every turn's prompt continues the last.
- ``score``: a context and 8 continuations scored one request after another with
  ``prompt_logprobs`` (what lm-evaluation-harness asks of a server for multiple choice).

One model, the variants interleaved round by round (off, on, on, off, ...) with the cache emptied
before each (``LLM.reset_prefix_cache``), so that "on" reuses only what the workload itself
computed. Prints per workload the median wall and prefill seconds of each variant, the prompt
tokens reused, the median of the per-round ratios, and the tokens each variant generated: in
bfloat16 a continued prompt's rows round differently from a whole one's, so seeded texts can part
at near-ties and the decode work differ (float32 keeps them equal, bar rare ties).

With ``--draft-model NAME`` the generating workloads speculate with that causal LM as a draft
model (``SpecConfig(drafter="model", draft_model=NAME)``), and "on" also lets it copy the prompts it
keeps (``DraftLM.kept``) rather than prefill each prompt whole; ``--draft-only`` keeps the target's
caching on in both variants, so that only the draft model's kept prompts are switched.

    python benchmarks/prefix_cache.py                 # all three, 3 rounds
    python benchmarks/prefix_cache.py --workloads chat --rounds 5 --dtype float32
    python benchmarks/prefix_cache.py --workloads fewshot,chat --draft-model smollm2-135m-instruct
    python benchmarks/prefix_cache.py --workloads fewshot,chat --draft-model smollm2-135m-instruct --draft-only
"""

from __future__ import annotations

import argparse
import statistics
import time

WORKLOADS = ("fewshot", "chat", "score")


def fewshot(llm, rounds_seed: int, spec=None):
    from multispec import SamplingParams
    from multispec.reasoning import load_gsm8k

    shots = load_gsm8k(limit=8, split="train")
    examples = "".join(f"Question: {p.question}\nAnswer: {p.data['solution']}\n\n" for p in shots)
    prompts = [examples + f"Question: {p.question}\nAnswer:" for p in load_gsm8k(limit=16)]
    params = SamplingParams(n=4, temperature=0.7, max_tokens=64, seed=rounds_seed, stop=["\n\nQuestion:"])
    return [lambda: llm.generate(prompts, params, spec, use_tqdm=False)]


def chat(llm, rounds_seed: int, spec=None):
    from multispec import SamplingParams
    from multispec.reasoning import load_gsm8k

    questions = [p.question for p in load_gsm8k(limit=24, offset=100)]
    conversations = [[] for _ in range(4)]
    params = SamplingParams(temperature=0.7, max_tokens=48, seed=rounds_seed)

    def turn(k):
        def call():
            for i, conversation in enumerate(conversations):
                conversation.append({"role": "user", "content": questions[6 * i + k]})
            outs = llm.chat(conversations, params, spec, use_tqdm=False)
            for conversation, out in zip(conversations, outs):
                conversation.append({"role": "assistant", "content": out.outputs[0].text})
            return outs
        return call
    return [turn(k) for k in range(6)]


def score(llm, rounds_seed: int, spec=None):
    from multispec import SamplingParams
    from multispec.reasoning import load_gsm8k

    shots = load_gsm8k(limit=5, split="train")
    context = "".join(f"Question: {p.question}\nAnswer: {p.data['solution']}\n\n" for p in shots)
    context += f"Question: {load_gsm8k(limit=1, offset=rounds_seed)[0].question}\nAnswer: The answer is"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    return [lambda c=c: llm.generate([context + f" {c}."], params, use_tqdm=False)
            for c in (12, 18, 20, 24, 36, 40, 48, 60)]


def run_once(llm, name: str, caching: bool, seed: int, spec=None,
             draft_only: bool = False) -> tuple[float, float, int, int, int]:
    """Wall and prefill seconds, prompt tokens, those reused and tokens generated, for one pass of
    a workload (``spec``: speculating with a draft model, whose kept prompts ``caching`` switches
    too; ``draft_only``: those alone, the target's caching on)."""
    from multispec.engine.prefix import KeptPrompts

    calls = globals()[name](llm, seed, spec)
    llm.reset_prefix_cache()
    llm.engine.scheduler.prefix_caching = caching or draft_only
    if spec is not None:
        llm.engine.draft_model(spec.draft_model).kept = KeptPrompts() if caching else None
    before = llm.engine.stats.copy()
    start = time.perf_counter()
    for call in calls:
        call()
    wall = time.perf_counter() - start
    done = llm.engine.stats.since(before)
    llm.engine.scheduler.prefix_caching = True
    return wall, done.time_prefill, done.prompt_tokens, done.cached_prompt_tokens, done.generated_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-model", default=None, help="speculate with this causal LM as the draft model")
    parser.add_argument("--draft-only", action="store_true",
                        help="with --draft-model: switch only its kept prompts, the target's caching on in both")
    args = parser.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    if not names or any(w not in WORKLOADS for w in names) or args.rounds < 1:
        parser.error(f"--workloads takes some of {','.join(WORKLOADS)}; --rounds at least 1")

    import torch

    from multispec import LLM, SpecConfig

    llm = LLM(dtype=args.dtype)
    spec = None
    if args.draft_only and args.draft_model is None:
        parser.error("--draft-only needs --draft-model")
    if args.draft_model is not None:
        if "score" in names:
            parser.error("--draft-model: the score workload generates one token a request; leave it out")
        spec = SpecConfig(drafter="model", draft_model=args.draft_model)
        llm.engine.draft_model(args.draft_model)  # loaded before any timing
    drafted = f", draft model {args.draft_model}" if spec is not None else ""
    drafted += " (its kept prompts off and on, the target's caching on in both)" if args.draft_only else ""
    print(f"{llm.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds{drafted}\n")
    print("| workload | prompt tokens | reused | wall s off | wall s on | wall on/off | prefill s off | "
          "prefill s on | prefill on/off | generated off / on |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        run_once(llm, name, True, 0, spec, args.draft_only)  # warm-up: shapes, kernels, memory
        runs = {False: [], True: []}
        for r in range(args.rounds):
            for caching in ((False, True) if r % 2 == 0 else (True, False)):
                runs[caching].append(run_once(llm, name, caching, r, spec, args.draft_only))
        off, on = runs[False], runs[True]
        med = lambda rows, i: statistics.median(row[i] for row in rows)  # noqa: E731
        wall = statistics.median(b[0] / a[0] for a, b in zip(off, on))
        prefill = statistics.median(b[1] / a[1] for a, b in zip(off, on))
        print(f"| {name} | {on[0][2]} | {on[0][3]} | {med(off, 0):.2f} | {med(on, 0):.2f} | {wall:.2f} | "
              f"{med(off, 1):.2f} | {med(on, 1):.2f} | {prefill:.2f} | {med(off, 4):.0f} / {med(on, 4):.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
