"""A draft LM cut from the target itself: its first k decoder layers, its final norm and its
(tied) output head, written as an ordinary checkpoint directory, then measured as a draft model.

The default model has no smaller sibling that ships offline, so this is the checkpoint draft
model one can build from it with no training: how often its drafts are accepted at each k, and
what that buys against plain decoding, with the target itself as the draft as the ceiling of
acceptance (q equal to p). Layers trained for the full depth are not trained to exit early, so
acceptance is expected to fall fast with k.

    python experiments/early_exit_draft.py --layers 6,10,15 --out /tmp/early-exit
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file


def write_truncated(source: Path, layers: int, out: Path) -> Path:
    """The first ``layers`` decoder layers of the checkpoint directory ``source`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
                continue
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="6,10,15")
    parser.add_argument("--out", default="/tmp/multispec-early-exit")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_spec import chat_stats
    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.models import load_checkpoint, resolve_model
    from multispec.reasoning import load_gsm8k

    source = load_checkpoint(resolve_model("smollm2-135m-instruct")).path
    drafts = {f"first {k} layers": str(write_truncated(source, int(k), Path(args.out) / f"layers-{k}"))
              for k in args.layers.split(",")}
    drafts["the target itself"] = "smollm2-135m-instruct"
    llm = LLM()
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    specs = {"plain": SpecConfig()}
    specs.update({name: SpecConfig(drafter="model", draft_model=path, max_draft_tokens=args.depth, adaptive=False,
                                   decision_threshold=0.0) for name, path in drafts.items()})
    measured: dict[str, list] = {}
    for run in range(args.runs):  # interleaved: every row once per run
        params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=run)
        for name, spec in specs.items():
            s = chat_stats(llm, conversations, params, spec, True)
            measured.setdefault(name, []).append(s)
            print(f"  run {run} {name:<18} {s.tokens_per_second:6.1f} tok/s tau {s.tau:.2f}", file=sys.stderr)
    print(f"\n{args.questions} questions x {args.n} one at a time, T {args.temperature}, depth {args.depth}, "
          f"{llm.dtype}; medians of {args.runs} runs\n")
    print("| draft | tau | acceptance | tok/s | speedup | draft share of the step |")
    print("|---|---|---|---|---|---|")
    for name, runs in measured.items():
        speedup = statistics.median(s.tokens_per_second / p.tokens_per_second for s, p in zip(runs, measured["plain"]))
        share = statistics.median(s.time_draft_model / max(1e-9, s.time_draft + s.time_forward + s.time_verify
                                                            + s.time_commit) for s in runs)
        print(f"| {name} | {statistics.median(s.tau for s in runs):.2f} | "
              f"{statistics.median(s.acceptance_rate for s in runs):.1%} | "
              f"{statistics.median(s.tokens_per_second for s in runs):.1f} | {speedup:.2f}x | {share:.0%} |")


if __name__ == "__main__":
    main()
