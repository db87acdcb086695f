"""Device placement: the ``device`` argument, and a generation path that never mixes host and
accelerator tensors.

Without a GPU, ``DeviceAudit`` (tests/device_audit.py) replays CUDA's rule on the CPU over a whole
generation in every mode the engine has, so a tensor left on the host in the hot path fails here
instead of on the first GPU run. With a GPU, the CUDA tests below also run the engine there.
"""

from __future__ import annotations

import pytest
import torch

from multispec import LLM, SamplingParams, SpecConfig
from multispec.api import resolve_device
from multispec.engine.cache import KVCache
from tests.device_audit import DeviceAudit, DeviceMix, mark

CUDA = torch.cuda.is_available()


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    with pytest.raises(ValueError, match="device='gpu0'"):
        resolve_device("gpu0")
    if not CUDA:
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="CUDA GPU"):
        resolve_device("cuda:99")


def test_llm_refuses_a_missing_device_before_loading():
    with pytest.raises(ValueError, match="device="):
        LLM(device="cuda:99")


def test_audit_catches_a_mix():
    """The audit has teeth: a host index into a device tensor, or a host operand, is refused."""
    weights = torch.ones(4, 3)
    mark(weights)
    with DeviceAudit():
        assert weights[1].shape == (3,)  # indexed with a Python int: fine
        rows = torch.tensor([0, 2], device=torch.device("cpu"))
        assert weights[rows].shape == (2, 3)
        with pytest.raises(DeviceMix, match="mixes"):
            weights[torch.tensor([0, 2])] + torch.zeros(2, 3)
        with pytest.raises(DeviceMix, match="mixes"):
            weights + torch.zeros(3)
        weights * torch.tensor(2.0)  # a 0-dim host tensor is a scalar, allowed as on CUDA
        with pytest.raises(DeviceMix, match="numpy"):
            weights.numpy()
        assert weights.cpu().numpy().shape == (4, 3)


AUDITED = {
    "plain": (SpecConfig(drafter="none"), dict(temperature=0.8)),
    "greedy consensus tree": (SpecConfig(drafter="consensus", max_draft_tokens=3, max_draft_nodes=6, adaptive=False),
                              dict(temperature=0)),
    "consensus, top-k/top-p, logprobs": (SpecConfig(drafter="consensus", adaptive=False),
                                         dict(temperature=0.7, top_k=50, top_p=0.9, logprobs=2)),
    "adaptive budget": (SpecConfig(drafter="consensus"), dict(temperature=0.7)),
    "sampled drafts": (SpecConfig(drafter="consensus", sampled_drafts=True, adaptive=False), dict(temperature=0.9)),
    "sampled, specinfer": (SpecConfig(drafter="consensus", sampled_drafts=True, scheme="specinfer", adaptive=False),
                           dict(temperature=0.9)),
    "ngram": (SpecConfig(drafter="ngram", adaptive=False), dict(temperature=0.7)),
    "portable path as on a GPU": (SpecConfig(drafter="consensus", max_draft_tokens=3, max_draft_nodes=6,
                                             adaptive=False), dict(temperature=0.7)),
    "rules and a grammar, as on a GPU": (SpecConfig(drafter="consensus", adaptive=False),
                                         dict(temperature=0.8, structured_outputs={"regex": "[ A-Za-z0-9,.]+"},
                                              logit_bias={11: 2.0}, repetition_penalty=1.1, bad_words=["Madrid"])),
}


@pytest.mark.parametrize("name", list(AUDITED))
def test_generation_never_mixes_host_and_device_tensors(llm, name, monkeypatch):
    """Two prompts (two prompt groups in one step) through every mode; stop strings and a short
    max_tokens retire samples mid-run. Fails with the offending operation if any step mixes."""
    spec, sampling = AUDITED[name]
    if name == "rules and a grammar, as on a GPU":  # the grammar's masks through torch's operators
        from multispec import kernels

        monkeypatch.setattr(kernels, "mask_rows", lambda: None)
    if name == "portable path as on a GPU":  # no compiled kernel; concatenated keys, torch's rms_norm
        from multispec.engine import attention
        from multispec.models.llama import RMSNorm

        monkeypatch.setattr(attention, "compiled_kernel", lambda device: None)
        monkeypatch.setattr(attention, "concat_keys", lambda device: True)
        monkeypatch.setattr(RMSNorm, "forward", RMSNorm.library_norm)
    # Every cache made during the run counts as on the device, as its explicit ``device=`` puts it
    # there on a GPU: also a scratch engine's (the draft budget's first calibration), whose CPU
    # store is mapped memory the audit cannot see being placed.
    made = KVCache.__init__

    def on_device_cache(self, *args, **kwargs):
        made(self, *args, **kwargs)
        mark(self.k_store, self.v_store)

    monkeypatch.setattr(KVCache, "__init__", on_device_cache)
    mark(*llm.model.parameters(), *llm.model.buffers())
    layers = llm.model.model.layers
    products = [p for layer in layers for p in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down)]
    mark(*(t for p in products + [llm.model.head] if p is not None for t in (p.weight, p.bias, p.stream, p.affine)
           if t is not None))
    if llm.model._rope_cache is not None:
        mark(*llm.model._rope_cache)
    cache = llm.engine.cache  # allocated on the model's device when the LLM was built
    mark(cache.k_store, cache.v_store)
    if cache.shape is not None:
        mark(cache.prompt_k, cache.prompt_v, cache.sample_k, cache.sample_v)
    prompts = ["The capital of France is Paris. The capital of Spain is Madrid. The capital of",
               "1, 2, 3, 4, 5, 6,"]
    params = [SamplingParams(n=3, max_tokens=12, seed=1, **sampling),
              SamplingParams(n=2, max_tokens=7, seed=2, stop=[","], **sampling)]
    audit = DeviceAudit()
    with audit:
        outputs = llm.generate(prompts, params, spec, use_tqdm=False)
        llm.logits(llm.tokenizer.encode("1, 2, 3"))
    assert audit.calls > 1000  # the mode saw the forward passes, not just the set-up
    assert [len(o.outputs) for o in outputs] == [3, 2]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_greedy_matches_cpu(llm):
    """Greedy ids on the GPU equal the CPU's (float32) for plain and speculative decoding."""
    gpu = LLM(device="cuda", dtype="float32")
    prompt = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
    params = SamplingParams(n=4, temperature=0, max_tokens=24)
    cpu_ids = [c.token_ids for c in llm.generate(prompt, params, SpecConfig(drafter="none"), use_tqdm=False)[0].outputs]
    for spec in (SpecConfig(drafter="none"), SpecConfig(drafter="consensus", adaptive=False),
                 SpecConfig(drafter="consensus", max_draft_tokens=3, max_draft_nodes=6, adaptive=False)):
        outputs = gpu.generate(prompt, params, spec, use_tqdm=False)[0].outputs
        # A near tie between the two likeliest tokens may break differently on another device's
        # arithmetic; the test prompt has none within its first 24 tokens.
        assert [c.token_ids for c in outputs] == cpu_ids


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_seeded_samples_equal_the_cpus(llm):
    """The random numbers are keyed by (seed, sample, position) the same way on every device, so
    seeded samples on the GPU equal the CPU's, but where a draw falls on a numerical tie."""
    from tests.helpers import assert_same_sampled_tokens

    gpu = LLM(device="cuda", dtype="float32")
    params = SamplingParams(n=6, temperature=0.8, max_tokens=24, seed=9)
    prompt = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
    cpu = llm.generate(prompt, params, SpecConfig(drafter="none"), use_tqdm=False)[0]
    got = gpu.generate(prompt, params, SpecConfig(drafter="consensus", adaptive=False), use_tqdm=False)[0]
    for a, b in zip(got.outputs, cpu.outputs):
        assert_same_sampled_tokens(llm, cpu.prompt_token_ids, a.token_ids, b.token_ids, 9, b.index, 0.8)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_seeded_sampling_is_reproducible():
    gpu = LLM(device="cuda", dtype="float32")
    params = SamplingParams(n=8, temperature=0.8, max_tokens=16, seed=7)
    spec = SpecConfig(drafter="consensus", adaptive=False)
    first = [c.token_ids for c in gpu.generate("Once upon a time", params, spec, use_tqdm=False)[0].outputs]
    second = [c.token_ids for c in gpu.generate("Once upon a time", params, spec, use_tqdm=False)[0].outputs]
    assert first == second
