"""The compiled decode attention of two source versions, alternating in one process.

Between processes a 2-core machine drifts by more than a few percent, so a change to the
attention kernel is timed here on the operator alone: the kernel sources of a git revision and of
the working tree are each compiled into a library of their own (the operator registered under its
own namespace), both are loaded into one process and called in turn on the same data, and the
outputs are compared bit for bit.

Shapes are ``B.own.L.P``: B samples (16 to a prompt), ``own`` keys of each sample's own text, L
draft tokens per sample in a binary tree (node r's parent (r - 1) // 2), a prompt of P keys. Each
call runs 30 layers with separate caches (as a decode step of the default model does, so that the
samples' own keys and values come from memory); the time is the median over ``--rounds``.

    python experiments/attention_builds.py --base HEAD~1 --shapes 16.128.0.127,16.128.2.127
    python experiments/attention_builds.py --dtype bfloat16 --kv-cache-dtype bfloat16
    python experiments/attention_builds.py --dtype bfloat16 --room 512   # slots laid out as the engine's
    python experiments/attention_builds.py --dtype bfloat16 --room 512 --cold   # keys and values from memory
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "multispec/kernels"
FILES = ("decode_attention.cpp", "decode_attention.h", "common.h", "amx_attention.h")


def sources(revision: str | None, into: Path, files: tuple[str, ...] = FILES) -> Path:
    """Kernel sources (the attention's unless ``files`` names others) at ``revision`` (None: the
    working tree) copied into ``into``."""
    into.mkdir(parents=True)
    for name in files:
        if revision is None:
            if (ROOT / KERNELS / name).exists():
                shutil.copy(ROOT / KERNELS / name, into / name)
        else:
            shown = subprocess.run(["git", "show", f"{revision}:{KERNELS}/{name}"], cwd=ROOT, capture_output=True,
                                   text=True)
            if shown.returncode == 0:  # (a header that revision did not have yet is left out)
                (into / name).write_text(shown.stdout)
    return into


def alternate(ops: dict, run, rounds: int) -> tuple[float, float, bool]:
    """``run(op)`` (a call's outputs, a list, and the seconds its calls took) for the base's and the
    tree's op in turn, ``rounds`` times: the median milliseconds of each, and whether their outputs
    agree bit for bit."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    outs = {}
    for _ in range(rounds):
        for name, op in ops.items():
            outs[name], seconds = run(op)
            times[name].append(seconds)
    base, tree = (statistics.median(times[name]) * 1e3 for name in ("base", "tree"))
    return base, tree, all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"]))


def build(src: Path, name: str):
    """decode_attention.cpp from ``src`` compiled as torch.ops.<name>.decode_attention."""
    from torch.utils import cpp_extension

    from multispec.kernels import FLAGS

    path = src / "decode_attention.cpp"
    for source in (path, src / "decode_attention.h"):
        if not source.exists():
            continue
        text = source.read_text()
        text = text.replace("TORCH_LIBRARY(multispec,", f"TORCH_LIBRARY({name},")
        text = text.replace("TORCH_LIBRARY_IMPL(multispec,", f"TORCH_LIBRARY_IMPL({name},")
        # Its own C++ namespace too: the dynamic linker would otherwise bind both registrations to
        # the first library's function.
        text = text.replace("namespace multispec {", f"namespace {name}_impl {{")
        text = text.replace("multispec::", f"{name}_impl::")
        source.write_text(text)
    cpp_extension.load(name=name, sources=[str(path)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                       build_directory=str(src), is_python_module=False, verbose=False)
    return getattr(torch.ops, name).decode_attention


def inputs(shape: str, dtype: torch.dtype, cache_dtype: torch.dtype, room: int = 0, layers: int = 30):
    batch, own, drafts, plen = map(int, shape.split("."))
    gen = torch.Generator().manual_seed(0)
    kv_heads, heads, dim = 3, 9, 64
    tokens, prompts = batch * (1 + drafts), -(-batch // 16)
    capacity = max(room, own + 1 + drafts)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    own_k, own_v = (torch.randn(layers, batch, kv_heads, capacity, dim, generator=gen).to(cache_dtype) for _ in "kv")
    prompt_k, prompt_v = (torch.randn(layers, prompts, kv_heads, plen, dim, generator=gen).to(cache_dtype)
                          for _ in "kv")
    slots, counts = torch.arange(batch), torch.full((batch,), 1 + drafts)
    offsets, written = slots * (1 + drafts), torch.full((batch,), own)
    mask = torch.zeros(1 + drafts, 1 + drafts, dtype=torch.bool)
    for node in range(1 + drafts):
        at = node
        while True:
            mask[node, at] = True
            if at == 0:
                break
            at = (at - 1) // 2
    index = (slots, offsets, counts, written, slots // 16, torch.full((batch,), plen),
             mask.expand(batch, -1, -1).contiguous())
    return [(q, k, v, own_k[i], own_v[i], prompt_k[i], prompt_v[i], *index, dim ** -0.5) for i in range(layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    parser.add_argument("--shapes", default="4.128.0.127,16.128.0.127,16.128.2.127,64.128.0.127,16.500.0.127")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"])
    parser.add_argument("--room", type=int, default=0,
                        help="positions a sample slot has room for (0: its keys and nothing more; the engine's "
                             "slots for 256-token answers have 512)")
    parser.add_argument("--cold", action="store_true",
                        help="before each layer read 9 MB of other memory, as a step reads a layer's weights "
                             "there: the keys and values then come from memory, as in a step (else each "
                             "round finds them in the last level cache the previous round filled)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cache_dtype = dtype if args.kv_cache_dtype == "auto" else torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="attention-builds-") as tmp:
        print(f"compiling {args.base} and the working tree ...", file=sys.stderr)
        ops = {"base": build(sources(args.base, Path(tmp) / "base"), "attention_base"),
               "tree": build(sources(None, Path(tmp) / "tree"), "attention_tree")}
        print(f"{args.dtype} activations, {cache_dtype} caches, {torch.get_num_threads()} threads; "
              f"base = {args.base}, tree = the working tree")
        print("| shape | base ms | tree ms | tree / base | same output |")
        print("|---|---|---|---|---|")
        for shape in args.shapes.split(","):
            calls = inputs(shape, dtype, cache_dtype, args.room)
            weights = torch.ones(len(calls), 9_000_000 // 2, dtype=torch.bfloat16) if args.cold else None

            def run(op, calls=calls, weights=weights):
                outs, seconds = [], 0.0
                for layer, call in enumerate(calls):
                    if weights is not None:
                        weights[layer].sum()
                    start = time.perf_counter()
                    outs.append(op(*call))
                    seconds += time.perf_counter() - start
                return outs, seconds

            base, tree, same = alternate(ops, run, args.rounds)
            print(f"| {shape} | {base:.2f} | {tree:.2f} | {tree / base:.3f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
