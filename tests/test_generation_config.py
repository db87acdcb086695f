"""A checkpoint's generation_config.json gives the default sampling settings, as in vLLM: for
``LLM.generate`` and ``chat`` without ``SamplingParams`` and for the server's requests that leave
the fields out; ``generation_config="vllm"`` (``--generation-config vllm``) turns that off."""

from __future__ import annotations

import json
import shutil

import pytest

from multispec import LLM, SamplingParams
from multispec.serve.sampling import Limits, chat_inputs, completion_inputs
from multispec.serve.schemas import ChatCompletionRequest, CompletionRequest

GENERATION = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.2, "max_new_tokens": 5,
              "do_sample": True, "bos_token_id": 1}


@pytest.fixture(scope="module")
def configured(successor_dir, tmp_path_factory):
    """The tiny model with a generation config that sets every field vLLM reads from one."""
    directory = tmp_path_factory.mktemp("configured") / "model"
    shutil.copytree(successor_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION))
    return directory


def test_generation_config_gives_the_default_sampling_params(configured):
    llm = LLM(str(configured), device="cpu", dtype="float32")
    want = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=1.2, max_tokens=5)
    assert llm.get_default_sampling_params() == want
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5  # max_new_tokens, where SamplingParams() would allow 16
    plain = LLM(str(configured), device="cpu", dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    elsewhere = LLM(str(configured), device="cpu", dtype="float32", generation_config=str(configured))
    assert elsewhere.generation_defaults == llm.generation_defaults


def test_the_servers_requests_take_the_defaults_they_leave_out(configured):
    """Fields a request leaves out come from the generation config, the ones it gives win; a chat's
    max_tokens left to the context window is capped by max_new_tokens."""
    llm = LLM(str(configured), device="cpu", dtype="float32")
    engine, spec, defaults = llm.engine, llm.spec, llm.generation_defaults
    left_out = completion_inputs(CompletionRequest(prompt="Hello"), engine, spec, Limits(), defaults).params
    assert (left_out.temperature, left_out.top_k, left_out.top_p, left_out.repetition_penalty) == (0.5, 3, 0.9, 1.2)
    given = completion_inputs(CompletionRequest(prompt="Hello", temperature=0.9, top_k=0), engine, spec, Limits(),
                              defaults).params
    assert (given.temperature, given.top_k, given.top_p) == (0.9, 0, 0.9)
    chat = chat_inputs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), engine, spec, Limits(),
                       None, defaults).params
    assert chat.max_tokens == 5 and chat.temperature == 0.5
    none = completion_inputs(CompletionRequest(prompt="Hello"), engine, spec, Limits(), {}).params
    assert (none.temperature, none.top_k, none.repetition_penalty) == (1.0, 0, 1.0)


@pytest.mark.parametrize("content,needle", [
    ({"temperature": -1}, "generation_config.json: temperature=-1"),
    ({"max_new_tokens": 0}, "generation_config.json: max_tokens=0"),
    ("[1, 2]", "generation_config.json: must hold a JSON object"),
    ("{bad", "malformed JSON in"),
])
def test_a_bad_generation_config_is_named(configured, tmp_path, content, needle):
    directory = tmp_path / "model"
    shutil.copytree(configured, directory)
    (directory / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=needle):
        LLM(str(directory), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        LLM(str(configured), device="cpu", generation_config="nowhere")


def test_the_generate_command_takes_the_defaults_its_flags_leave_out(configured):
    """``multispec generate``: the law's flags left out take the generation config, those given win
    (the other commands keep their own defaults: gsm8k and eval sample at T 0.7)."""
    from multispec.cli import _sampling, build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--top-k", "7"])
    params = _sampling(args, {"temperature": 0.5, "top_k": 3, "repetition_penalty": 1.2})
    assert (params.temperature, params.top_k, params.repetition_penalty, params.top_p) == (0.5, 7, 1.2, 1.0)
    assert _sampling(args).temperature == 1.0  # before the model is known: the command's own default
    gsm = parser.parse_args(["gsm8k"])
    assert _sampling(gsm, {"temperature": 0.5}).temperature == 0.7
