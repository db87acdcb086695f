"""GGUF files written by llama.cpp's own converter, read back by multispec.

The loading tests write their GGUF files with a writer that lays tensors out the way llama.cpp's
converter does (tests/models/conftest.py). This checks the reader against the converter itself:
for each architecture multispec runs, a tiny random checkpoint (norm weights of their own, so a
shifted or missing norm shows) is converted by llama.cpp's ``convert_hf_to_gguf.py`` (F32) in a
process of its own, loaded with ``load_checkpoint``, and compared tensor by tensor and field by
field with the checkpoint it came from.

llama.cpp's converter ships in llama-cpp-python's source distribution (``pip download
llama-cpp-python==0.3.36 --no-deps --no-binary :all:``, then unpack ``vendor/llama.cpp``). The tiny
checkpoints' byte-level tokenizer is none the converter knows by its hash, so the converter is
told to call its pre-tokenizer "gpt-2" and to write Gemma's, Gemma 2's and Phi-3's vocabularies
as byte-level ones (it looks for a SentencePiece file); the tensors and the model's metadata are
the converter's own. The converter needs ``sentencepiece`` importable (``pip install
sentencepiece``, here or on PYTHONPATH).

    python experiments/llama_cpp_gguf.py --llama-cpp /path/to/vendor/llama.cpp [--outtype q8_0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from multispec.models import ModelConfig, load_checkpoint  # noqa: E402
from tests.models.conftest import like_trained  # noqa: E402
from tests.models.test_loading import save_tiny  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "smollm3", "granite", "olmo2"]

_DRIVER = """
import sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root))
sys.path.insert(1, str(root / "gguf-py"))
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import conversion.gemma as gemma
import conversion.phi as phi
for cls in (gemma.GemmaModel, gemma.Gemma2Model, phi.Phi3MiniModel):
    cls.set_vocab = base.TextModel._set_vocab_gpt2
import importlib.util
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", root / "convert_hf_to_gguf.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", sys.argv[4]]
module.main()
"""


def check(arch: str, llama_cpp: Path, work: Path, outtype: str) -> tuple[str, str, str]:
    source = work / arch / "source"
    save_tiny(source, arch, tie=arch in ("llama", "gemma", "gemma2", "gemma3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    if arch == "gemma3":  # the converter cuts Gemma 3's embedding to what it counts as the tokenizer's
        spec = json.loads((source / "tokenizer.json").read_text())
        hf.resize_token_embeddings(len(spec["model"]["vocab"]) + len(spec["added_tokens"]))
    like_trained(hf, norms=True)
    hf.config.bos_token_id, hf.config.eos_token_id = 1, 2  # the tiny tokenizer's <s> and </s>, as it names them
    hf.save_pretrained(source)
    gguf = work / arch / "tiny.gguf"
    run = subprocess.run([sys.executable, "-c", _DRIVER, str(llama_cpp), str(source), str(gguf), outtype],
                         capture_output=True, text=True)
    if run.returncode != 0:
        return arch, "converter failed", run.stderr.strip().splitlines()[-1]
    try:
        checkpoint = load_checkpoint(gguf, cache_dir=work / arch / "cache")
    except ValueError as error:
        return arch, "refused", str(error)
    want = hf.state_dict()
    if hf.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    if sorted(want) != sorted(checkpoint.tensors):
        return arch, "tensor names differ", str(sorted(set(want) ^ set(checkpoint.tensors))[:4])
    shapes = [f"{name} {tuple(checkpoint.tensors[name].shape)} (checkpoint {tuple(tensor.shape)})"
              for name, tensor in want.items() if checkpoint.tensors[name].shape != tensor.shape]
    if shapes:
        return arch, "tensor shapes differ", "; ".join(shapes)
    # Q8_0 keeps each block of 32 as int8 times a scale of the block's largest magnitude / 127: an
    # error of at most half a step, 1/254 of that magnitude (reported relative to the tensor's).
    worst = max(((checkpoint.tensors[name] - tensor).abs().max() / tensor.abs().max().clamp_min(1e-30)).item()
                for name, tensor in want.items())
    got, expected = checkpoint.config, ModelConfig.from_hf_dict(hf.config.to_dict())
    fields = [f for f in got.__dataclass_fields__ if getattr(got, f) != getattr(expected, f)]
    detail = ", ".join(f"{f}: {getattr(got, f)!r} (checkpoint {getattr(expected, f)!r})" for f in fields)
    return arch, f"largest tensor difference {worst:.2e} of the tensor's largest value", detail or "config equal"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (its converter)")
    parser.add_argument("--arch", nargs="*", default=ARCHS, choices=ARCHS)
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                        help="what the converter writes (q8_0: products quantised, norms kept in F32)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        for arch in args.arch:
            print(" | ".join(check(arch, args.llama_cpp, Path(work), args.outtype)), flush=True)


if __name__ == "__main__":
    main()
