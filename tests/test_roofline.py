"""The arithmetic of ``benchmarks/roofline.py``: what a step must read and compute at least."""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import roofline  # noqa: E402
from tests.models.test_parity import tiny  # noqa: E402


def test_weights_are_every_product_of_every_layer_and_the_head_once():
    _, model = tiny("llama")
    products, layers = roofline.model_products(model)
    assert layers == len(model.model.layers)
    per_layer = sum(p.numel() for name, p in model.model.layers[0].named_parameters() if "norm" not in name)
    assert sum(math.prod(p.shape) for p in products) == per_layer  # fused weights cover q, k, v, o, gate, up, down
    head = model.output_weight().numel()
    assert roofline.weight_bytes(model) == 4 * (layers * per_layer + head)


def test_the_prompt_is_read_once_for_all_samples():
    _, model = tiny("llama")
    config = model.config
    one = roofline.kv_bytes(config, 2, 1, 0, 1)
    assert one == 2 * config.num_key_value_heads * config.head_dim * 2 * config.num_hidden_layers
    assert roofline.kv_bytes(config, 2, 16, 100, 10) == one * (100 + 16 * 10)


def test_gemm_seconds_counts_the_flops_of_one_forward():
    _, model = tiny("llama")
    with torch.inference_mode():
        seconds, flops = roofline.gemm_seconds(model, 3, repeats=1)
    products, layers = roofline.model_products(model)
    assert seconds > 0
    assert flops == 2 * 3 * (layers * sum(math.prod(p.shape) for p in products) + model.output_weight().numel())
