"""The streaming matrix products of two source versions, alternating in one process.

Between processes a 2-core machine drifts by more than a few percent, so a change to
``stream_gemm.cpp`` is timed here: the kernel sources of a git revision and of the working tree
are each compiled into a library of their own (operators and C++ namespaces renamed), both are
loaded into one process and run in turn on the default model's own packed weights, and the
outputs are compared bit for bit.

A pass is what a decode step's products do at ``rows`` rows: for each of the 30 layers the fused
q/k/v, o, fused gate/up and down products (each weight read from memory, the output a fresh
tensor), then the output head; the weights in the form the engine reads them at that many rows
(float32: integer blocks up to ``affine_rows()``, else the float32 stream; bfloat16 on a CPU with
AMX tiles or AVX512-BF16 vectors: the bf16 stream, up to ``stream_rows()`` rows). Median over
``--rounds``.

    python experiments/stream_builds.py --base HEAD --rows 4,16,64,128
    python experiments/stream_builds.py --base HEAD --base-flags revision   # flags changed too
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_builds import ROOT, alternate, sources  # noqa: E402

FILES = ("stream_gemm.cpp", "common.h", "amx_attention.h")


def flags_at(revision: str | None) -> list[str]:
    """The kernels' compiler flags (``FLAGS`` in multispec/kernels/__init__.py) at ``revision``
    (None: the working tree)."""
    if revision is None:
        from multispec.kernels import FLAGS

        return list(FLAGS)
    text = subprocess.run(["git", "show", f"{revision}:multispec/kernels/__init__.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FLAGS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit(f"no FLAGS in multispec/kernels/__init__.py at {revision}")


def build(src: Path, name: str, flags: list[str]):
    """stream_gemm.cpp from ``src`` compiled with ``flags`` as torch.ops.<name>.stream_linear."""
    from torch.utils import cpp_extension

    for file in FILES:
        path = src / file
        text = path.read_text()
        # Every namespace of the copy renamed: the dynamic linker would otherwise bind both
        # libraries' inline functions and registrations to the first one loaded.
        text = text.replace("multispec_kernels", f"{name}_kernels").replace("multispec_amx", f"{name}_amx")
        text = text.replace("TORCH_LIBRARY_FRAGMENT(multispec,", f"TORCH_LIBRARY({name},")
        text = text.replace("TORCH_LIBRARY_IMPL(multispec,", f"TORCH_LIBRARY_IMPL({name},")
        text = text.replace("namespace multispec {", f"namespace {name}_impl {{")
        text = text.replace("&multispec::", f"&{name}_impl::")
        path.write_text(text)
    cpp_extension.load(name=name, sources=[str(src / "stream_gemm.cpp")], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], build_directory=str(src), is_python_module=False, verbose=False)
    return getattr(torch.ops, name).stream_linear


def products(model, rows: int) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
    """(packed weight, bias, input width) of every product of a forward of ``rows`` rows, in order."""
    from multispec.models.llama import affine_rows, stream_rows

    if rows > stream_rows():
        raise SystemExit(f"{rows} rows: products of more than {stream_rows()} rows do not stream on this CPU")
    out = []
    for layer in model.model.layers:
        for p in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
            packed = p.affine if p.affine is not None and rows <= affine_rows() else p.stream
            out.append((packed, p.bias, p.shape[1]))
    head = model.head
    out.append((head.affine if head.affine is not None and rows <= affine_rows() else head.stream, head.bias,
                head.shape[1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    parser.add_argument("--rows", default="4,16,64,128")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base-flags", choices=["tree", "revision"], default="tree",
                        help="compile the base with the working tree's flags (isolates the source change) or "
                             "with its own revision's")
    args = parser.parse_args()

    from multispec import LLM, kernels

    if kernels.stream_kind() not in (1, 2, 3):
        sys.exit("this compares the streaming products (a CPU with AMX, AVX512-BF16 or AVX2 and FMA)")
    dtype = torch.float32 if kernels.stream_kind() == 3 else torch.bfloat16
    llm = LLM(dtype=str(dtype).removeprefix("torch."))
    if llm.model.head is None or llm.model.head.stream is None:
        sys.exit("the model's weights are not packed for the streaming products")
    with tempfile.TemporaryDirectory(prefix="stream-builds-") as tmp:
        print(f"compiling {args.base} and the working tree ...", file=sys.stderr)
        base_flags = flags_at(args.base if args.base_flags == "revision" else None)
        ops = {"base": build(sources(args.base, Path(tmp) / "base", FILES), "stream_base", base_flags),
               "tree": build(sources(None, Path(tmp) / "tree", FILES), "stream_tree", flags_at(None))}
        print(f"{dtype}, {torch.get_num_threads()} threads; base = {args.base} ({args.base_flags}'s flags), tree = the "
              f"working tree")
        print("| rows | base ms | tree ms | tree / base | same output |")
        print("|---|---|---|---|---|")
        gen = torch.Generator().manual_seed(0)
        for rows in (int(r) for r in args.rows.split(",")):
            calls = products(llm.model, rows)
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {c[2] for c in calls}}
            def run(op, calls=calls, xs=xs):
                start = time.perf_counter()
                outs = [op(xs[k], packed, bias) for packed, bias, k in calls]
                return outs, time.perf_counter() - start

            base, tree, same = alternate(ops, run, args.rounds)
            print(f"| {rows} | {base:.2f} | {tree:.2f} | {tree / base:.3f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
