"""Plain decoding of a checkpoint shaped as a real model, random weights: multispec against
transformers' ``generate`` in one process, the two alternating.

No checkpoint of these can be downloaded here, so this times the shape, which is what a step
costs: ``--arch qwen3`` Qwen3-0.6B (28 layers, hidden 1024, 16 query heads of 128 over 8 KV heads,
a 151,936-token tied head; its decode steps run the compiled layer stack), ``--arch gemma2``
Gemma-2-2B (26 layers, hidden 2304, 8 query heads of 256 over 4 KV heads, a 256,000-token tied
head, soft-capped scores and logits), ``--arch olmo2`` OLMo-2-0425-1B (16 layers, hidden 2048,
16 heads of 128, a 100,352-token untied head), ``--arch gemma3`` Gemma-3-1B (26 layers,
hidden 1152, 4 query heads of 256 over one KV head, a 262,144-token tied head, five of every six
layers windowed to 512 positions and rotated by their own base; its decode steps run the compiled
layer stack, the windows in its attention: ``--prompt-tokens 600`` times steps past them),
``--arch gemma3-270m``
Gemma-3-270M (the same with 18 layers, hidden 640). The weights are transformers' random
initialisation and the tokenizer a word-level stand-in of the same size. Every sample runs to
``--max-tokens`` (ignore_eos; transformers' end token is unset), so both engines generate the
same number of tokens. tokens/s = generated tokens / wall seconds of the call; medians of
``--runs`` calls.

    .venv/bin/python experiments/architecture_shape.py --arch qwen3 --prompts 4 --n 16 --max-tokens 128 --runs 3
    .venv/bin/python experiments/architecture_shape.py --arch gemma2 --prompts 2 --n 8 --max-tokens 64 --runs 3
    .venv/bin/python experiments/architecture_shape.py --arch olmo2 --prompts 2 --n 8 --max-tokens 64 --runs 3
    .venv/bin/python experiments/architecture_shape.py --arch gemma3 --prompts 2 --n 8 --max-tokens 64 --runs 3
    .venv/bin/python experiments/architecture_shape.py --arch gemma3 --prompts 2 --n 8 --max-tokens 64 --runs 3 \
        --prompt-tokens 600
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

SHAPES = {
    "qwen3": ("Qwen3-0.6B", transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)),
    "gemma2": ("Gemma-2-2B", transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)),
    "gemma3": ("Gemma-3-1B", transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, query_pre_attn_scalar=256,
        sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)),
    "gemma3-270m": ("Gemma-3-270M", transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, query_pre_attn_scalar=256,
        sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)),
    "olmo2": ("OLMo-2-0425-1B", transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)),
}


def write_checkpoint(directory: Path, arch: str) -> int:
    """The checkpoint and its stand-in tokenizer; returns the vocabulary's size."""
    _, config_class, model_class, shape = SHAPES[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**shape)).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return shape["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(SHAPES), default="qwen3")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        vocab_size = write_checkpoint(directory, args.arch)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, vocab_size, (args.prompt_tokens,), generator=gen).tolist()
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
        print(f"{SHAPES[args.arch][0]} shape, random weights, bf16, {args.prompts} x {args.n} samples, "
              f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, {torch.get_num_threads()} threads")
        for name, values in rates.items():
            print(f"  {name:13s} {statistics.median(values):7.1f} tok/s  ({', '.join(f'{v:.1f}' for v in values)})")
        ratios = [a / b for a, b in zip(rates["multispec"], rates["transformers"])]
        each = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"  multispec / transformers: {statistics.median(ratios):.2f}x (per-run {each})")


if __name__ == "__main__":
    main()
