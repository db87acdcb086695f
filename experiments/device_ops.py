"""Operations and host reads per decode step on the device path, replayed on the CPU.

On a GPU the engine runs the portable path: no compiled CPU kernels, the attention of each
sample over its prompt's and its own keys concatenated, in one ``scaled_dot_product_attention``
call a layer (``concat_keys``), and torch's ``rms_norm``. Each aten operation there is a dispatch
from Python and, unless it is a view, a kernel launch; each ``.item()``, ``.tolist()``, ``.cpu()``
or truth test of a device tensor waits for the device. This script runs the same path on the CPU
(``MULTISPEC_KERNELS=0``, the GPU's forms of attention and norm; ``--cpu-forms`` for the CPU's:
two attention halves merged by their log-sum-exp, the element-wise norm) and counts both per
decode step of one request, overall and inside the attention. Counts, not times: they do not
depend on the machine, and where the step is bound by its dispatches (docs/results.md, "On a
GPU") they are what to reduce.

    python experiments/device_ops.py                    # one request of 4 samples, plain decoding
    python experiments/device_ops.py --n 16 --spec hybrid --cpu-forms
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ["MULTISPEC_KERNELS"] = "0"
os.environ.setdefault("MULTISPEC_NO_PROGRESS", "1")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import multispec.engine.attention as attention  # noqa: E402

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Reads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4, help="samples of the one request")
    parser.add_argument("--spec", default="plain", choices=("plain", "consensus", "hybrid"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=15, help="operations listed")
    parser.add_argument("--cpu-forms", action="store_true",
                        help="the portable path's CPU forms: the attention in two softmax halves merged by "
                             "log-sum-exp and the element-wise RMS norm, instead of one attention call over the "
                             "concatenated keys and torch's rms_norm (what a GPU runs)")
    args = parser.parse_args()

    # As on a GPU: the portable attention, no compiled kernel.
    attention.kernel_for = lambda device: attention._reference_kernel
    attention.compiled_kernel = lambda device: None
    attention.concat_keys = lambda device: not args.cpu_forms
    if not args.cpu_forms:
        from multispec.models.llama import RMSNorm

        RMSNorm.forward = RMSNorm.library_norm
    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.reasoning import load_gsm8k

    spec = {"plain": SpecConfig(drafter="none"), "consensus": SpecConfig(),
            "hybrid": SpecConfig(drafter="hybrid")}[args.spec]
    llm = LLM(dtype="float32")
    conversation = load_gsm8k(limit=1)[0].chat()
    params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=0)
    llm.chat([conversation], params, spec, use_tqdm=False)  # warm: first-call set-up is not a step's

    inside = Ops()
    attend = attention.DecodeAttention.attend

    def counted(self, *a, **k):
        with inside:
            return attend(self, *a, **k)

    attention.DecodeAttention.attend = counted
    ops, reads = Ops(), Reads()
    with ops, reads:
        llm.chat([conversation], params, spec, use_tqdm=False)
    steps = llm.last_stats.decode_forwards
    total = sum(ops.ops.values())
    views = sum(v for k, v in ops.ops.items() if k.split(".")[-1] in (
        "view", "slice", "select", "transpose", "reshape", "unsqueeze", "squeeze", "permute", "expand",
        "as_strided", "t", "alias", "_unsafe_view", "split", "chunk", "unbind", "promote_types"))
    layers = llm.engine.model.config.num_hidden_layers
    print(f"n {args.n}, {args.spec}: {steps} decode steps; aten operations per step {total / steps:.0f} "
          f"(views and type queries {views / steps:.0f}), in the attention {sum(inside.ops.values()) / steps:.0f} "
          f"({sum(inside.ops.values()) / steps / layers:.0f} a layer); host reads per step "
          f"{sum(reads.reads.values()) / steps:.1f} "
          f"({', '.join(f'{k} {v / steps:.1f}' for k, v in reads.reads.most_common())})")
    for name, count in ops.ops.most_common(args.top):
        print(f"  {name:36s} {count / steps:7.1f} a step")


if __name__ == "__main__":
    main()
