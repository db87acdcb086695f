"""Bad input is refused with a ValueError naming the field (API) or one line and exit 2 (CLI)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from multispec import SamplingParams, SpecConfig
from multispec.models import resolve_model


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("max_tokens", 0), ("logprobs", -1), ("seed", "x"), ("stop", [""]),
])
def test_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", [("drafter", "oracle"), ("scheme", "magic"), ("batching", "ragged"),
                                         ("max_draft_tokens", -1), ("min_ngram", 0)])
def test_spec_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SpecConfig(**{field: value})


def test_unknown_model_and_missing_file():
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="missing.gguf"):
        resolve_model("/tmp/definitely/missing.gguf")


def test_prompt_errors(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[1] * (llm.config.max_position_embeddings + 5)], SamplingParams())
    with pytest.raises(ValueError, match="token ids outside"):
        llm.generate([[llm.config.vocab_size + 3]], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "multispec.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["--n", "0"], "n=0"), (["--temperature", "-1"], "temperature=-1"), (["--top-p", "2"], "top_p=2"),
    (["--top-k", "-3"], "top_k=-3"), (["--max-tokens", "0"], "max_tokens=0"),
    (["--model", "no-such-model"], "no-such-model"),
])
def test_cli_reports_one_line_and_exits_2(args, needle):
    result = run_cli("generate", "--prompt", "hi", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr


def test_cli_missing_prompt():
    result = run_cli("generate")
    assert result.returncode == 2 and "--prompt" in result.stderr
