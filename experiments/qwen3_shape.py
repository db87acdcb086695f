"""Plain decoding of a checkpoint shaped as Qwen3-0.6B, random weights: multispec against
transformers' ``generate`` in one process, the two alternating.

No Qwen3 checkpoint can be downloaded here, so this times the shape (28 layers, hidden 1024,
16 query heads of 128 over 8 KV heads, a 151,936-token tied head), which is what a step costs;
the weights are transformers' random initialisation and the tokenizer a word-level stand-in of
the same size. Every sample runs to ``--max-tokens`` (ignore_eos; transformers' end token is
unset), so both engines generate the same number of tokens. tokens/s = generated tokens / wall
seconds of the call; medians of ``--runs`` calls.

    .venv/bin/python experiments/qwen3_shape.py --prompts 4 --n 16 --max-tokens 128 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from multispec import LLM, SamplingParams

SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)


def write_checkpoint(directory: Path) -> None:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(SHAPE["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_checkpoint(directory)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, SHAPE["vocab_size"], (args.prompt_tokens,), generator=gen).tolist()
                   for _ in range(args.prompts)]
        llm = LLM(str(directory), dtype="bfloat16", enable_prefix_caching=False)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True, seed=0)

        def ours() -> int:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        def theirs() -> int:
            ids = torch.tensor(prompts)
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.7, top_p=1.0,
                                  top_k=0, num_return_sequences=args.n, max_new_tokens=args.max_tokens,
                                  min_new_tokens=args.max_tokens, pad_token_id=0)
            return out[:, ids.shape[1]:].numel()

        rates: dict[str, list[float]] = {"multispec": [], "transformers": []}
        for name, run in (("multispec", ours), ("transformers", theirs)):  # warm-up (kernels, first-call costs)
            run()
        for _ in range(args.runs):
            for name, run in (("multispec", ours), ("transformers", theirs)):
                start = time.perf_counter()
                tokens = run()
                rates[name].append(tokens / (time.perf_counter() - start))
        print(f"Qwen3-0.6B shape, random weights, bf16, {args.prompts} x {args.n} samples, "
              f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, {torch.get_num_threads()} threads")
        for name, values in rates.items():
            print(f"  {name:13s} {statistics.median(values):7.1f} tok/s  ({', '.join(f'{v:.1f}' for v in values)})")
        ratios = [a / b for a, b in zip(rates["multispec"], rates["transformers"])]
        each = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"  multispec / transformers: {statistics.median(ratios):.2f}x (per-run {each})")


if __name__ == "__main__":
    main()
