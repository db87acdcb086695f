"""The fused attention kernel against the reference built from elementary operations."""

from pathlib import Path

import pytest
import torch

from multispec import kernels
from multispec.engine.attention import _FLASH_CPU, _fused_kernel, _reference_kernel, kernel_for

COMPILED = kernels.decode_attention() is not None


@pytest.mark.skipif(_FLASH_CPU is None, reason="this torch has no fused CPU attention kernel")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("mask_shape", [None, "per row", "per prompt"])
@pytest.mark.parametrize("kernel", [_fused_kernel, _reference_kernel], ids=["fused", "batched"])
def test_kernels_match_a_float64_reference(dtype, tol, mask_shape, kernel):
    """Output and log-sum-exp, on strided cache views (room past the keys read) and with the
    masks the decode step builds: one per query row (own half), one broadcast over rows (prompt
    half), none. The log-sum-exp is compared to a float64 reference: it carries the merge."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, rows, keys, dim = 5, 3, 6, 37, 64
    q = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    room = torch.randn(2, batch, heads, keys + 11, dim, generator=gen).to(dtype)
    k, v = room[0, :, :, :keys], room[1, :, :, :keys]
    mask = None
    if mask_shape == "per row":
        visible = torch.rand(batch, 1, rows, keys, generator=gen) < 0.7
        visible[..., 0] = True
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    elif mask_shape == "per prompt":
        lengths = torch.tensor([37, 20, 5, 36, 1])
        pad = torch.arange(keys)[None, :] >= lengths[:, None]
        mask = torch.zeros(batch, 1, 1, keys, dtype=dtype).masked_fill_(pad[:, None, None], float("-inf"))
    out, lse = kernel(q, k, v, mask)
    ref_out, ref_lse = _reference_kernel(q.double(), k.double(), v.double(), None if mask is None else mask.double())
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.allclose(out.double(), ref_out, atol=tol, rtol=tol)
    # The batched kernel's bf16 products round each score to bf16 (8 bits) before its float32
    # softmax: scores here reach about 4, so 4 * 2**-9 bounds that rounding.
    lse_tol = 1e-2 if kernel is _reference_kernel and dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(lse.double(), ref_lse.double(), atol=lse_tol, rtol=1e-5)


def test_devices_without_the_fused_kernel_get_the_reference():
    assert kernel_for(torch.device("meta")) is _reference_kernel
    if _FLASH_CPU is not None:
        assert kernel_for(torch.device("cpu")) is _fused_kernel



def _config(heads: int = 4, kv_heads: int = 2, head_dim: int = 8, positions: int = 64, window: int | None = None,
            cap: float | None = None):
    """One attention layer; by default four query heads sharing two kv heads of 8 dimensions;
    ``window``: a sliding window of that many positions; ``cap``: scores soft-capped (Gemma 2's)."""
    from multispec.models.config import ModelConfig

    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=heads * head_dim,
                       intermediate_size=8, num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=positions,
                       rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                       attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_ids=[],
                       sliding_window=window, attn_logit_softcapping=cap)


@pytest.mark.parametrize("window", [None, 7], ids=["whole", "window"])
@pytest.mark.parametrize("concat", [False, True], ids=["halves", "concatenated"])
def test_samples_in_any_slots_see_their_text_and_only_the_drafted_ancestors(concat, window, monkeypatch):
    """``StepLayout.slots`` and ``scratch`` (a draft model's tree, one depth a forward): samples
    living in slots 2 and 0, each row attending to the prompt, its sample's text, the earlier
    drafted nodes its mask names and itself, against attention written out key by key; through
    the compiled kernel where it is built, except under a window. "window": a sliding window of 7
    positions, a row at position p seeing the prompt's and text's keys after p - 7 (a node's
    position: the prompt, the text and its drafted ancestors before it), on the portable path."""
    from multispec.engine.attention import DecodeAttention, StepLayout
    from multispec.engine.cache import CacheShape, KVCache
    config = _config(window=window)
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(config, 3 * 12 + 5, torch.float32)
    cache.layout(CacheShape(3, 12, 1, 5))
    for store in (cache.prompt_k, cache.prompt_v, cache.sample_k, cache.sample_v):
        store.copy_(torch.randn(store.shape, generator=gen))
    slots, written, scratch, counts = [2, 0], [6, 4], [3, 2], [2, 1]
    sees = torch.zeros(2, 2, 3, dtype=torch.bool)
    sees[0, 0, [0, 2]] = True
    sees[0, 1, 1] = True
    sees[1, 0, 1] = True
    layout = StepLayout(counts=torch.tensor(counts), written=torch.tensor(written),
                        prompt_slot=torch.zeros(2, dtype=torch.long), prompt_len=torch.tensor([5, 5]),
                        tree_mask=torch.eye(2, dtype=torch.bool).expand(2, 2, 2).clone(), slots=torch.tensor(slots), scratch=torch.tensor(scratch), scratch_mask=sees)
    q = torch.randn(3, 4, 8, generator=gen)
    k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    monkeypatch.setattr("multispec.engine.attention.concat_keys", lambda device: concat)
    attention = DecodeAttention(cache, layout)
    assert (attention.op is not None) == (COMPILED and window is None)
    out = attention.attend(0, q, k, v)
    row = 0
    for b, (slot, w, s, c) in enumerate(zip(slots, written, scratch, counts)):
        for i in range(c):
            position = 5 + w - s + int(sees[b, i].sum())
            low = 0 if window is None else position - window + 1
            seen = [t for t in range(5) if t >= low]
            own = [j for j in range(w - s) if 5 + j >= low] + [w - s + j for j in range(s) if sees[b, i, j]] + [w + i]
            keys = torch.cat([cache.prompt_k[0, 0][:, seen], cache.sample_k[0, slot][:, own]], 1)    # [kvh, K, D]
            values = torch.cat([cache.prompt_v[0, 0][:, seen], cache.sample_v[0, slot][:, own]], 1)
            assert torch.equal(cache.sample_k[0, slot][:, w + i], k[row])  # the new keys were written in place
            for h in range(4):
                weights = torch.softmax(keys[h // 2] @ q[row, h] / 8 ** 0.5, -1)
                assert torch.allclose(out[row, h], weights @ values[h // 2], atol=1e-5)
            row += 1


@pytest.mark.parametrize("prompt_slots", [[0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 2, 2], [0, 0, 0, 1, 1, 2], [1, 1, 2, 2, 0, 0]],
                         ids=["prompt-major-equal", "interleaved", "unequal", "slots-out-of-order"])
@pytest.mark.parametrize("counts", [[1] * 6, [2, 1, 1, 2, 1, 1]], ids=["plain", "drafted"])
@pytest.mark.parametrize("compiled", [True, False, "concatenated"], ids=["compiled", "portable", "concatenated"])
@pytest.mark.parametrize("split", [False, True], ids=["one-part", "split"])
@pytest.mark.parametrize("window", [None, 5], ids=["whole", "window"])
def test_samples_of_several_prompts_see_their_own_prompt(prompt_slots, counts, compiled, split, window, monkeypatch):
    """Six samples of three prompts of different lengths, grouped in order, interleaved, in groups
    of unequal size and with prompt slots out of order (the prompt half scatters them into one
    padded prompt-major layout): each row attends to its own prompt, its own text and its
    ancestors, against attention written out key by key. "concatenated": the portable path as it
    runs off the CPU (``concat_keys``), each sample's prompt and own keys in one call. "split":
    the drafted steps in two parts (root rows in place, draft rows gathered). "window": a sliding
    window of 5 positions: rows see part of their prompt, or none of it, and part of their text."""
    from multispec.engine.attention import DecodeAttention, StepLayout
    from multispec.engine.cache import CacheShape, KVCache
    config = _config(window=window)
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(config, 6 * 10 + 3 * 7, torch.float32)
    cache.layout(CacheShape(6, 10, 3, 7))
    for store in (cache.prompt_k, cache.prompt_v, cache.sample_k, cache.sample_v):
        store.copy_(torch.randn(store.shape, generator=gen))
    lengths = {0: 7, 1: 4, 2: 6}
    written = [3, 5, 2, 4, 6, 1]
    tree = torch.zeros(6, 2, 2, dtype=torch.bool)
    tree[:, 0, 0] = tree[:, 1, 1] = tree[:, 1, 0] = True  # a chain: the draft node sees the root
    layout = StepLayout(counts=torch.tensor(counts), written=torch.tensor(written),
                        prompt_slot=torch.tensor(prompt_slots), prompt_len=torch.tensor([lengths[s] for s in prompt_slots]),
                        tree_mask=tree)
    rows = sum(counts)
    q = torch.randn(rows, 4, 8, generator=gen)
    k, v = torch.randn(rows, 2, 8, generator=gen), torch.randn(rows, 2, 8, generator=gen)
    concat = compiled == "concatenated"
    monkeypatch.setattr("multispec.engine.attention.concat_keys", lambda device: concat)
    compiled = compiled is True
    attention = DecodeAttention(cache, layout, split=split, compiled=compiled)
    assert (attention.op is not None) == (compiled and COMPILED)
    assert all(part.concat == concat for part in attention.parts + (attention.window_parts or []))
    # The compiled kernel windows the layers itself; the portable path builds parts that window.
    assert (attention.window_parts is not None) == (window is not None and attention.op is None)
    out = attention.attend(0, q, k, v)
    row = 0
    dead = 0  # rows whose window holds none of their prompt
    for b, (slot, w, c) in enumerate(zip(prompt_slots, written, counts)):
        for i in range(c):
            position = lengths[slot] + w + i
            low = 0 if window is None else position - window + 1
            seen = [t for t in range(lengths[slot]) if t >= low]
            dead += not seen
            own = [j for j in range(w + i + 1) if lengths[slot] + j >= low]
            keys = torch.cat([cache.prompt_k[0, slot][:, seen], cache.sample_k[0, b][:, own]], 1)
            values = torch.cat([cache.prompt_v[0, slot][:, seen], cache.sample_v[0, b][:, own]], 1)
            for h in range(4):
                weights = torch.softmax(keys[h // 2] @ q[row, h] / 8 ** 0.5, -1)
                assert torch.allclose(out[row, h], weights @ values[h // 2], atol=1e-5)
            row += 1
    assert (dead > 0) == (window is not None)  # the window leaves some rows none of their prompt


def _has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not COMPILED, reason="the compiled kernel is not built on this machine")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize("in_slots", [False, True], ids=["packed", "slots"])
@pytest.mark.parametrize("amx", ["1", "0"], ids=["tiles", "vectors"])
@pytest.mark.parametrize("window,cap", [(None, None), (20, None), (3, None), (None, 3.0), (20, 3.0)],
                         ids=["whole", "window-20", "window-3", "capped", "capped-window"])
def test_compiled_kernel_matches_float64_on_trees_and_several_prompts(dtype, tol, in_slots, amx, window, cap,
                                                                       monkeypatch):
    """The compiled decode attention against the portable path in float64 on the same cache: six
    samples of three prompts, plain roots, a chain of 17 nodes (more than one block of 16 keys), a
    branching tree, two roots side by side, samples in packed slots and in slots out of order.
    The bf16 bound is the rounding of the output (values reach about 8: 2**-6 relative). On a CPU
    with AMX, bf16 samples with draft nodes run on the tile unit unless MULTISPEC_AMX=0: both paths.
    "window-20": a sliding window that starts past the first block of sixteen of some prompts and
    of some samples' own keys (the kernel skips those); "window-3": one shorter than the chain, so
    that its deep nodes see only their nearest ancestors among the step's new keys. "capped": scores
    soft-capped at 3 (they reach about 12 here, so the cap changes most of them)."""
    monkeypatch.setenv("MULTISPEC_AMX", amx)
    out, want = _compiled_on_trees(dtype, in_slots, window, cap)
    assert out.dtype == dtype
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not (COMPILED and _has_amx()), reason="no compiled kernel or no AMX here")
def test_tile_path_runs_and_agrees_with_the_vector_path(monkeypatch):
    """The tile path rounds the softmax weights to bf16 before the values' product (the vector
    path keeps them in float32): the two agree within a few units of bf16's last place of the
    output, and differ somewhere (so that the switch really changes the path taken)."""
    monkeypatch.setenv("MULTISPEC_AMX", "1")
    tiles, want = _compiled_on_trees(torch.bfloat16, True)
    monkeypatch.setenv("MULTISPEC_AMX", "0")
    vectors, _ = _compiled_on_trees(torch.bfloat16, True)
    assert not torch.equal(tiles, vectors)
    assert torch.allclose(tiles.float(), vectors.float(), atol=2e-2, rtol=2 ** -6)
    # no worse against float64 than the vector path, beyond the output's own rounding
    assert (tiles.double() - want).abs().max() <= (vectors.double() - want).abs().max() + 2e-2


@pytest.mark.skipif(not COMPILED, reason="the compiled kernel is not built on this machine")
@pytest.mark.parametrize("amx,dtype,window", [("1", torch.bfloat16, None), ("0", torch.bfloat16, None),
                                              ("0", torch.float32, None), ("1", torch.bfloat16, 20),
                                              ("0", torch.float32, 20)],
                         ids=["tiles", "vectors", "float32", "window", "float32-window"])
def test_a_samples_attention_does_not_depend_on_the_other_samples_of_the_step(amx, dtype, window, monkeypatch):
    """With AMX the prompt half runs sixteen query rows of a prompt's samples to a tile: each
    sample's output must still be bit for bit what it is when the sample is alone in the step (no
    padding, blocking or order effect), on both paths and in float32 (whose scores run eight keys
    to a block where the CPU has AVX2 but no AVX-512). Six samples of three prompts, plain and
    drafted, slots out of order; "window": under a sliding window of 20 positions."""
    from multispec.engine.attention import DecodeAttention, StepLayout
    from tests.helpers import tree_mask_of

    monkeypatch.setenv("MULTISPEC_AMX", amx)
    out, _ = _compiled_on_trees(dtype, True, window)
    cache, layout, q, k, v = _compiled_on_trees.last
    row = 0
    for b, count in enumerate(layout.counts.tolist()):
        alone = StepLayout(layout.counts[b:b + 1], layout.written[b:b + 1], layout.prompt_slot[b:b + 1],
                           layout.prompt_len[b:b + 1], tree_mask_of([_TREES[b]]), slots=layout.slots[b:b + 1])
        mine = DecodeAttention(cache, alone).attend(0, q[row:row + count], k[row:row + count], v[row:row + count])
        assert torch.equal(mine, out[row:row + count]), f"sample {b}"
        row += count


_TREES = [[], [-1, 0, 0], [-1], [-1, -1, 0, 1, 2], [], list(range(-1, 16))]


def _compiled_on_trees(dtype, in_slots, window=None, cap=None):
    from multispec.engine.attention import DecodeAttention, StepLayout
    from multispec.engine.cache import CacheShape, KVCache
    from tests.helpers import tree_mask_of

    # the default model's shape
    config = _config(heads=9, kv_heads=3, head_dim=64, positions=4096, window=window, cap=cap)
    gen = torch.Generator().manual_seed(3)
    shape = CacheShape(7, 80, 3, 50)
    cache, exact = KVCache(config, shape.tokens(), dtype), KVCache(config, shape.tokens(), torch.float64)
    cache.layout(shape)
    exact.layout(shape)
    for name in ("prompt_k", "prompt_v", "sample_k", "sample_v"):
        getattr(cache, name).copy_(torch.randn(getattr(cache, name).shape, generator=gen) * 2)
        getattr(exact, name).copy_(getattr(cache, name))
    trees = _TREES
    counts = [1 + len(t) for t in trees]
    layout = StepLayout(torch.tensor(counts), torch.tensor([3, 17, 40, 0, 33, 21]), torch.tensor([0, 1, 0, 2, 2, 1]),
                        torch.tensor([50, 7, 50, 31, 31, 7]), tree_mask_of(trees),
                        slots=torch.tensor([6, 2, 0, 5, 1, 3]) if in_slots else None)
    rows = sum(counts)
    q = (torch.randn(rows, 9, 64, generator=gen) * 2).to(dtype)
    k, v = (torch.randn(rows, 3, 64, generator=gen).to(dtype) for _ in range(2))
    compiled = DecodeAttention(cache, layout)
    assert compiled.op is not None
    out = compiled.attend(0, q, k, v)
    want = DecodeAttention(exact, layout, split=False, compiled=False).attend(0, q.double(), k.double(), v.double())
    slots = layout.slots.tolist() if in_slots else list(range(len(counts)))
    row = 0
    for slot, written, count in zip(slots, layout.written.tolist(), counts):  # the new keys were written in place
        assert torch.equal(cache.sample_k[0, slot, :, written:written + count], k[row:row + count].transpose(0, 1))
        assert torch.equal(cache.sample_v[0, slot, :, written:written + count], v[row:row + count].transpose(0, 1))
        row += count
    _compiled_on_trees.last = (cache, layout, q, k, v)
    return out, want


def test_compiled_kernel_is_built_where_a_compiler_is(monkeypatch):
    """Where the machine has a C++ compiler and ninja, the kernel builds (a silent fallback would
    hide a slower engine); MULTISPEC_KERNELS=0 turns it off."""
    import shutil

    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja here: the portable path is the engine's")
    assert COMPILED
    monkeypatch.setenv("MULTISPEC_KERNELS", "0")
    assert kernels.decode_attention() is None


def test_concatenated_attention_decodes_as_the_halves(llm, monkeypatch):
    """The default model on the portable path (no compiled kernel), two prompts in one step,
    plain greedy decoding and a greedy consensus tree: the attention as it runs off the CPU
    (``concat_keys``: prompt and own keys in one call) gives the tokens the two merged halves
    give. Float32, whose rounding is far below the gaps between real logits."""
    from multispec import SamplingParams, SpecConfig
    from multispec.engine import attention

    monkeypatch.setattr(attention, "compiled_kernel", lambda device: None)
    prompts = ["The capital of France is Paris. The capital of Spain is Madrid. The capital of",
               "Count: 1, 2, 3, 4, 5,"]
    params = [SamplingParams(n=2, temperature=0, max_tokens=20), SamplingParams(n=3, temperature=0, max_tokens=14)]
    runs = {}
    for concat in (False, True):
        monkeypatch.setattr(attention, "concat_keys", lambda device: concat)
        for name, spec in (("plain", SpecConfig(drafter="none")),
                           ("tree", SpecConfig(drafter="consensus", max_draft_tokens=3, max_draft_nodes=6,
                                               adaptive=False))):
            outputs = llm.generate(prompts, params, spec, use_tqdm=False)
            runs[concat, name] = [[o.token_ids for o in r.outputs] for r in outputs]
    assert runs[True, "plain"] == runs[False, "plain"]
    assert runs[True, "tree"] == runs[False, "tree"]
    assert runs[False, "tree"] == runs[False, "plain"]  # greedy drafts change nothing


def _skip_native_bf16(dtype) -> None:
    """Bit-for-bit claims hold for float32 activations (with either cache) on every vector path,
    and for bf16 ones where bf16 is read as floats (AVX2); with AVX512-BF16 the scores of bf16
    keys come from dot products sixteen keys to a block, a remainder summed otherwise, and bf16
    steps may part at near-ties only (tests/engine/test_bf16.py)."""
    from multispec.devices import cpu_has_fast_bf16

    if dtype == torch.bfloat16 and cpu_has_fast_bf16():
        pytest.skip("bf16 activations on bf16 arithmetic: exact only up to near-ties")


@pytest.mark.skipif(not COMPILED, reason="the compiled kernel is not built on this machine")
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)],
                         ids=["float32", "bfloat16-cache", "bfloat16"])
def test_a_roots_attention_does_not_depend_on_its_own_draft_count(dtype, cache_dtype, monkeypatch):
    """A sample's root row sees its cached keys and its own new key, never its draft nodes: its output
    must be the same float whether the sample drafted 0 or 9 nodes. Its softmax total once came from
    a vector reduction whose order (where the remainder starts) moved with the key count, so a
    drafted root parted from the plain one by rounding at some prompt lengths (37 of the ones
    below). Chains of 1-9 nodes against prompts of 5-127 keys and 0-40 own keys, vector path."""
    from multispec.engine.attention import DecodeAttention, StepLayout
    from multispec.engine.cache import CacheShape, KVCache
    from tests.helpers import tree_mask_of

    _skip_native_bf16(dtype)
    monkeypatch.setenv("MULTISPEC_AMX", "0")
    config = _config(heads=9, kv_heads=3, head_dim=64, positions=4096)
    gen = torch.Generator().manual_seed(11)
    shape = CacheShape(1, 64, 1, 128)
    for plen in (5, 37, 40, 127):
        for written in (0, 13, 40):
            cache = KVCache(config, shape.tokens(), cache_dtype, compute_dtype=dtype)
            cache.layout(shape)
            for name in ("prompt_k", "prompt_v", "sample_k", "sample_v"):
                getattr(cache, name).copy_(torch.randn(getattr(cache, name).shape, generator=gen) * 2)
            q, k, v = (torch.randn(10, h, 64, generator=gen).to(dtype) for h in (9, 3, 3))
            outs = []
            for drafts in range(10):
                layout = StepLayout(torch.tensor([1 + drafts]), torch.tensor([written]), torch.tensor([0]),
                                    torch.tensor([plen]), tree_mask_of([list(range(-1, drafts - 1))]))
                outs.append(DecodeAttention(cache, layout).attend(0, q[:1 + drafts], k[:1 + drafts], v[:1 + drafts])[0])
            for drafts, out in enumerate(outs):
                assert torch.equal(out, outs[0]), f"prompt {plen}, {written} own keys, {drafts} drafts"


@pytest.mark.skipif(not COMPILED, reason="the compiled kernel is not built on this machine")
def test_a_bfloat16_cache_under_float32_reads_back_exactly():
    """A bfloat16 cache under float32 activations: the new keys and values are stored rounded (to
    nearest, as torch rounds), and the attention is the float32 attention over the rounded cache,
    bit for bit; the portable path agrees with float64 over the same rounded values."""
    from multispec.engine.attention import DecodeAttention
    from multispec.engine.cache import KVCache

    out, want = _compiled_on_trees(torch.float32, True)  # a float32 cache, for the layout and inputs
    wide, layout, q, k, v = _compiled_on_trees.last
    config = wide.config
    narrow = KVCache(config, wide.shape.tokens(), torch.bfloat16, compute_dtype=torch.float32)
    rounded = KVCache(config, wide.shape.tokens(), torch.float32)
    exact = KVCache(config, wide.shape.tokens(), torch.float64)
    for cache in (narrow, rounded, exact):
        cache.layout(wide.shape)
    gen = torch.Generator().manual_seed(5)
    for name in ("prompt_k", "prompt_v", "sample_k", "sample_v"):
        values = (torch.randn(getattr(wide, name).shape, generator=gen) * 2).bfloat16()
        for cache in (narrow, rounded, exact):
            getattr(cache, name).copy_(values)
    got = DecodeAttention(narrow, layout).attend(0, q, k, v)
    assert got.dtype == torch.float32
    ref = DecodeAttention(rounded, layout).attend(0, q, k.bfloat16().float(), v.bfloat16().float())
    assert torch.equal(got, ref)
    for name in ("sample_k", "sample_v"):  # the step's new keys and values, rounded in place
        assert torch.equal(getattr(narrow, name).float(), getattr(rounded, name))
    portable = DecodeAttention(narrow, layout, compiled=False).attend(0, q, k, v)
    want = DecodeAttention(exact, layout, split=False, compiled=False).attend(
        0, q.double(), k.bfloat16().double(), v.bfloat16().double())
    assert portable.dtype == torch.float32
    assert (portable.double() - want).abs().max() < 2e-5
    assert (got.double() - want).abs().max() < 2e-5


@pytest.mark.skipif(not COMPILED, reason="the compiled kernel is not built on this machine")
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)],
                         ids=["float32", "bfloat16-cache", "bfloat16"])
@pytest.mark.parametrize("window", [None, 4, 30], ids=["whole", "window-4", "window-30"])
def test_a_draft_node_attends_as_the_same_token_does_as_a_root_later(dtype, cache_dtype, window, monkeypatch):
    """A node deep in one branch of a draft tree sees its ancestors, which sit among the other
    branch's nodes in the step's new keys; once accepted, the same token is a root whose ancestors
    are cached keys in a row. Its attention must be the same float both ways, or speculation would
    change the samples by rounding: a tree of two branches (parents -1, 0, 0, 1, 2), the last node
    (path: root, node 0, node 2, itself) against prompts of 5-127 keys, vector path. Under a
    sliding window the kernel starts each sample's keys where its root's window does, a few
    positions earlier in the drafted step than in the later one: the node must still weigh the
    same keys in the same order (window 4: it sees only its path; 30: part of the prompt)."""
    from multispec.engine.attention import DecodeAttention, StepLayout
    from multispec.engine.cache import CacheShape, KVCache
    from tests.helpers import tree_mask_of

    _skip_native_bf16(dtype)
    monkeypatch.setenv("MULTISPEC_AMX", "0")
    config = _config(heads=9, kv_heads=3, head_dim=64, positions=4096, window=window)
    gen = torch.Generator().manual_seed(17)
    shape = CacheShape(1, 64, 1, 128)
    parents = [-1, 0, 0, 1, 2]
    path = [0, 1, 3]  # the last node's ancestors, as rows of the step (root = 0)
    for plen in (5, 37, 40, 127):
        for written in (0, 13, 40):
            tree, plain = (KVCache(config, shape.tokens(), cache_dtype, compute_dtype=dtype) for _ in range(2))
            for cache in (tree, plain):
                cache.layout(shape)
            for name in ("prompt_k", "prompt_v", "sample_k", "sample_v"):
                values = torch.randn(getattr(tree, name).shape, generator=gen) * 2
                getattr(tree, name).copy_(values)
                getattr(plain, name).copy_(values)
            q, k, v = (torch.randn(6, h, 64, generator=gen).to(dtype) for h in (9, 3, 3))
            drafted = DecodeAttention(tree, StepLayout(torch.tensor([6]), torch.tensor([written]), torch.tensor([0]),
                                                       torch.tensor([plen]), tree_mask_of([parents])))
            deep = drafted.attend(0, q, k, v)[5]
            for rank, row in enumerate(path):  # the accepted path, committed in a row
                plain.sample_k[0, 0, :, written + rank] = tree.sample_k[0, 0, :, written + row]
                plain.sample_v[0, 0, :, written + rank] = tree.sample_v[0, 0, :, written + row]
            later = DecodeAttention(plain, StepLayout(torch.tensor([1]), torch.tensor([written + 3]), torch.tensor([0]),
                                                      torch.tensor([plen]), tree_mask_of([[]])))
            root = later.attend(0, q[5:], k[5:], v[5:])[0]
            assert torch.equal(deep, root), f"prompt {plen}, {written} own keys"


@pytest.mark.skipif(_FLASH_CPU is None, reason="this torch has no fused CPU attention kernel")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_runs_the_fused_kernel_and_matches_a_causal_reference(dtype, tol):
    """Each packed prompt attends causally to itself alone, with grouped keys, through the CPU's
    fused kernel (without a batch dimension the library falls back to its unfused reference,
    2-4.7x slower at 128-2048 tokens); its keys and values land in its prompt slot."""
    from multispec.engine.attention import PrefillAttention
    from multispec.engine.cache import CacheShape, KVCache
    from multispec.models.config import ModelConfig

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=6 * 16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=None,
                         eos_token_ids=[])
    cache = KVCache(config, 2 * 40, dtype, torch.device("cpu"))
    cache.layout(CacheShape(0, 0, 2, 40))
    slots = [cache.take_prompt_slot() for _ in range(2)]
    lengths = [23, 40]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths), 6, 16, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lengths), 2, 16, generator=gen).to(dtype) for _ in range(2))
    with torch.profiler.profile() as prof:
        out = PrefillAttention(cache, list(zip(slots, lengths))).attend(0, q, k, v)
    assert any("flash_attention" in e.key for e in prof.key_averages())
    start = 0
    for slot, n in zip(slots, lengths):
        qq, kk, vv = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))
        kk, vv = kk.repeat_interleave(3, 0), vv.repeat_interleave(3, 0)
        scores = (qq @ kk.transpose(1, 2)) / 4.0 + torch.full((n, n), float("-inf")).triu(1).double()
        want = (scores.softmax(-1) @ vv).transpose(0, 1)
        assert torch.allclose(out[start:start + n].double(), want, atol=tol, rtol=tol)
        assert torch.equal(cache.prompt_k[0, slot, :, :n], k[start:start + n].transpose(0, 1))
        start += n
