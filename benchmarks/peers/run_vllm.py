"""benchmarks/peers runner for vLLM's CPU build (run with benchmarks/peers/envs/vllm's python; run.py
starts it).

vLLM loads the Hugging Face directory the project converts the default GGUF into. The prompts
are the token ids run.py wrote (the same chat-templated prompts every engine gets), all in one
``LLM.generate`` call with ``SamplingParams(n=...)``. ``--ngram K`` turns on vLLM's n-gram
(prompt lookup) speculation with K draft tokens, matching n-grams of 1 to K tokens.

vLLM's own pitfalls, handled here: the engine core starts with spawn, so everything runs under
the ``__main__`` guard; the seed is the engine's (``LLM(seed=...)``), because a per-request seed
crashed the CPU runner once prompts were chunked; the KV cache is ``VLLM_CPU_KVCACHE_SPACE``
GiB (4 unless set). vLLM binds its compute threads to cores and keeps one core for its scheduler
(``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``VLLM_CPU_OMP_THREADS_BIND`` change that; the notes name
them when set). The prefix cache is emptied before every call, so no call reuses the
prompts of the one before it (within a call, vLLM shares what it can, as it would for new prompts).
run.py puts the libraries vLLM's CPU guide recommends (tcmalloc, Intel's OpenMP) in LD_PRELOAD where
it finds them; the notes name the ones that were preloaded.
"""

from __future__ import annotations

import os

from _common import load_workload, log, parse_args, report, timed_calls

NAME = "vllm"


def counters(llm) -> dict[str, float]:
    """vLLM's cumulative counters by name (labels summed); empty when the engine keeps none."""
    totals: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - the counters only feed the notes column
        return totals
    for metric in metrics:
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            totals[metric.name] = totals.get(metric.name, 0) + value
    return totals


def main() -> None:
    args = parse_args(__doc__, lambda p: (p.add_argument("--dtype", default="bfloat16"),
                                          p.add_argument("--ngram", type=int, default=0,
                                                         help="draft tokens of n-gram speculation (0: off)")))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # Read before vLLM adds its own entries to LD_PRELOAD for the engine core it starts.
    preloaded = [os.path.basename(p).split(".so")[0] for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    workload = load_workload(args.workload)
    import vllm
    from vllm import LLM, SamplingParams

    options = {}
    if args.ngram:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram,
                                         "prompt_lookup_max": args.ngram, "prompt_lookup_min": 1}
    llm = LLM(model=workload["hf_dir"], dtype=args.dtype, seed=0, disable_log_stats=False, **options)
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompt_token_ids"]]
    end_ids = set(workload["eos_token_ids"])
    log(NAME, f"vLLM {vllm.__version__}, {args.dtype}, KV cache {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB, "
              f"n-gram speculation {args.ngram or 'off'}")

    def call(seed: int) -> tuple[int, dict]:
        del seed  # the engine's seed; a per-request seed crashes the CPU runner (see the top of this file)
        llm.reset_prefix_cache()
        params = SamplingParams(n=args.n, temperature=workload["temperature"], top_p=workload["top_p"], top_k=0,
                                max_tokens=args.max_tokens)
        before = counters(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        after = counters(llm)
        tokens = 0
        for out in outputs:
            for sample in out.outputs:
                ids = list(sample.token_ids)
                tokens += len(ids)
                # vLLM keeps the end token in token_ids; count it if a version ever leaves it out.
                if sample.finish_reason == "stop" and sample.stop_reason is None and (not ids or ids[-1] not in end_ids):
                    tokens += 1
        delta = {name.removeprefix("vllm:"): after[name] - before.get(name, 0) for name in after}
        keep = ("prompt_tokens", "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        return tokens, {name: delta[name] for name in keep if name in delta}

    timings = timed_calls(NAME, call, args.runs)
    last = timings[-1]
    notes = [f"LD_PRELOAD {' + '.join(preloaded)}" if preloaded else "no LD_PRELOAD"]
    notes += [f"{name}={os.environ[name]}" for name in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND")
              if name in os.environ]
    if "prompt_tokens" in last:
        notes.append(f"{last['prompt_tokens']:.0f} prompt tokens"
                     + (f", {last['prefix_cache_hits']:.0f} served by the prefix cache" if "prefix_cache_hits" in last
                        else ""))
    if args.ngram and last.get("spec_decode_num_draft_tokens"):
        accepted = last.get("spec_decode_num_accepted_tokens", 0) / last["spec_decode_num_draft_tokens"]
        notes.append(f"{accepted:.1%} of {last['spec_decode_num_draft_tokens']:.0f} draft tokens accepted")
    report(engine=NAME, version=vllm.__version__, dtype=args.dtype, timings=timings, notes="; ".join(notes))


if __name__ == "__main__":
    main()
