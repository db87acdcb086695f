"""benchmarks/peers runner for transformers ``generate`` (run with the project's .venv python, which
has transformers; run.py starts it).

The model is the Hugging Face directory the project converts the default GGUF into, loaded with
SDPA attention in ``--dtype``. All prompts (the token ids run.py wrote) go in one left-padded
batch with ``num_return_sequences=n``: pure sampling at the workload's temperature (``top_k=0``
turns off the library's default top-k of 50, ``top_p`` 1). A sample's tokens count up to and
including its first end token; the padding after it does not count.
"""

from __future__ import annotations

from _common import count_until_end, load_workload, log, parse_args, report, timed_calls

NAME = "transformers"


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument("--dtype", default="bfloat16"))
    workload = load_workload(args.workload)
    import torch
    import transformers

    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(workload["hf_dir"], dtype=dtype,
                                                              attn_implementation="sdpa").eval()
    end_ids = workload["eos_token_ids"]
    pad = end_ids[0]  # any id: padded positions are masked out
    prompts = workload["prompt_token_ids"]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    log(NAME, f"transformers {transformers.__version__}, torch {torch.__version__}, {args.dtype}, "
              f"{torch.get_num_threads()} threads, batch {len(prompts)} x {width} (left-padded)")

    def call(seed: int) -> tuple[int, dict]:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                 temperature=workload["temperature"], top_p=workload["top_p"], top_k=0,
                                 max_new_tokens=args.max_tokens, num_return_sequences=args.n,
                                 eos_token_id=end_ids, pad_token_id=pad)
        rows = out[:, width:].tolist()
        return sum(count_until_end(row, set(end_ids)) for row in rows), {}

    timings = timed_calls(NAME, call, args.runs)
    report(engine=NAME, version=transformers.__version__, dtype=args.dtype, timings=timings,
           notes="left-padded batch, num_return_sequences")


if __name__ == "__main__":
    main()
