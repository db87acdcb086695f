"""Plain against prepacked weights for a decode step's matrix products, per row count.

Times all products of a 30-layer stack shaped like the default model (fused q/k/v 960 x 576, o
576 x 576, fused gate/up 3072 x 576, down 576 x 1536; weights far larger than any cache, so they
stream from memory as in a step) at 1 to 512 rows: ``F.linear`` on plain weights, and oneDNN's
linear on weights packed once with a row-count hint of 1, 16 and 128. Then the output head
(49,152 x 576) alone. Median of 5 passes.

    python experiments/packed_gemm.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from multispec.models.llama import packing_available

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = (1, 4, 16, 64, 128, 512)


def median_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[repeats // 2] * 1e3, 1)


def packed(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def main() -> None:
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        if not packing_available(dtype, "cpu"):  # bf16 packing needs AVX512-BF16 (or AVX-NE-CONVERT)
            print(dtype, "skipped: oneDNN cannot pack it on this CPU")
            continue
        layers = [[torch.randn(o, i, dtype=dtype) * 0.02 for o, i in SHAPES] for _ in range(30)]
        inputs = {m: [torch.randn(m, i, dtype=dtype) for _, i in SHAPES] for m in ROWS}

        def stack(kernel, weights, m):
            return lambda: [kernel(x, w) for layer in weights for w, x in zip(layer, inputs[m])]

        print(dtype, "plain", {m: median_ms(stack(lambda x, w: F.linear(x, w), layers, m)) for m in ROWS})
        for hint in (1, 16, 128):
            weights = [[torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in layer] for layer in layers]
            print(dtype, f"packed (hint {hint})", {m: median_ms(stack(packed, weights, m)) for m in ROWS})
        head = torch.randn(49152, 576, dtype=dtype) * 0.02
        head_packed = torch.ops.mkldnn._reorder_linear_weight(head, 16)
        for m in (1, 4, 16, 128):
            x = torch.randn(m, 576, dtype=dtype)
            print(dtype, f"head, {m} rows: plain {median_ms(lambda: F.linear(x, head))} ms, "
                  f"packed {median_ms(lambda: packed(x, head_packed))} ms")


if __name__ == "__main__":
    main()
