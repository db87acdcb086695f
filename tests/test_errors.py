"""Bad input is refused with a ValueError naming the field and the value (API), or one line on
stderr and exit status 2 (CLI), before any work starts; never a traceback from inside torch.

Written as one table of inputs per entry point: a new field joins its table.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pydantic
import pytest

from multispec import LLM, SamplingParams, SpecConfig, StructuredOutputsParams
from multispec.cli import main
from multispec.models import resolve_model

SAMPLING_BAD = [
    ("n", 0), ("n", 1.5), ("n", True), ("n", "3"), ("n", None),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "0.7"),
    ("temperature", True), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", "1"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("min_p", None),
    ("repetition_penalty", 0.0), ("repetition_penalty", math.inf), ("frequency_penalty", 2.5),
    ("presence_penalty", -3), ("presence_penalty", "1"),
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", None),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", None), ("min_tokens", 17),  # max_tokens is 16
    ("stop", [""]), ("stop", 5), ("stop", [1]), ("stop", ""),
    ("stop_token_ids", [-1]), ("stop_token_ids", 5), ("stop_token_ids", ["a"]), ("stop_token_ids", [True]),
    ("ignore_eos", "no"), ("ignore_eos", 1),
    ("logit_bias", [1]), ("logit_bias", {"a": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {True: 1.0}),
    ("logit_bias", {5: 101}), ("logit_bias", {5: math.nan}), ("logit_bias", {5: "1"}),
    ("include_stop_str_in_output", 1), ("skip_special_tokens", "no"),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", [" "]), ("bad_words", [1]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", "5"),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", 5), ("allowed_token_ids", [1.0]),
    ("seed", "x"), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5), ("seed", True),
    ("logprobs", -1), ("logprobs", 1.5), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", "2"),
]


@pytest.mark.parametrize("field,value", SAMPLING_BAD)
def test_sampling_params_name_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        SamplingParams(**{field: value})


STRUCTURED_BAD = [
    ({}, "structured_outputs: give exactly one of json, regex, choice, grammar or json_object"),
    ({"regex": "a", "choice": ["a"]}, "(not regex and choice)"), ({"json_object": False}, "give exactly one"),
    ({"json": 5}, "structured_outputs.json=5"), ({"regex": ""}, "structured_outputs.regex=''"),
    ({"grammar": 3}, "structured_outputs.grammar=3"), ({"choice": []}, "structured_outputs.choice=[]"),
    ({"choice": "a"}, "structured_outputs.choice='a'"), ({"choice": ["a", ""]}, "structured_outputs.choice=['a', '']"),
    ({"json_object": "yes"}, "structured_outputs.json_object='yes'"),
    ({"regex": "a", "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace=1"),
    ({"schema": {}}, "structured_outputs={'schema': {}}: unknown field 'schema'"),
    # compiled on construction: the syntax and the schema's rules, before any model is loaded
    ({"regex": "(ab"}, "structured_outputs.regex: at 1(8): invalid regex"),
    ({"json": "{bad"}, "structured_outputs.json: "),
    ({"json": {"type": "frobnicate"}}, "structured_outputs.json: Invalid type: frobnicate"),
    ({"grammar": "start: missing"}, 'structured_outputs.grammar: at 1(8): unknown name: "missing"'),
    ({"grammar": 'root ::= "a" | b'}, "structured_outputs.grammar: Failed to convert the grammar from GBNF to Lark"),
]


@pytest.mark.parametrize("value,needle", STRUCTURED_BAD)
def test_structured_outputs_name_the_field(value, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SamplingParams(structured_outputs=value)


def test_structured_outputs_refuse_min_tokens_and_other_types():
    """A grammar may allow only the end of the text before min_tokens, so the two are refused
    together; a StructuredOutputsParams or a dict of its fields is taken, nothing else."""
    with pytest.raises(ValueError, match=re.escape("min_tokens=2: cannot be combined with structured_outputs")):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match=re.escape("structured_outputs='a+'")):
        SamplingParams(structured_outputs="a+")

    class Reply(pydantic.BaseModel):
        answer: int

    assert StructuredOutputsParams(json=Reply).json == Reply.model_json_schema()
    assert SamplingParams(structured_outputs={"choice": ("a", "b")}).structured_outputs == StructuredOutputsParams(
        choice=["a", "b"])


def test_sampling_params_conventions():
    """vLLM's: temperatures too small for a softmax are greedy; top_k -1 is off; seeds are 64-bit."""
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-5).seed == -5
    assert SamplingParams(stop="END").stop == ["END"]


SPEC_BAD = [
    ({"drafter": "oracle"}, "drafter='oracle'"), ({"drafter": None}, "drafter=None"),
    ({"scheme": "magic"}, "scheme='magic'"),
    ({"max_draft_tokens": -1}, "max_draft_tokens=-1"), ({"max_draft_tokens": "3"}, "max_draft_tokens='3'"),
    ({"max_draft_nodes": 1.5}, "max_draft_nodes=1.5"), ({"max_draft_nodes": True}, "max_draft_nodes=True"),
    ({"sampled_drafts": "yes"}, "sampled_drafts='yes'"), ({"aggregate": "no"}, "aggregate='no'"),
    ({"adaptive": "no"}, "adaptive='no'"), ({"adaptive": 0}, "adaptive=0"),
    ({"max_ngram": 0}, "max_ngram=0"), ({"min_ngram": 0}, "min_ngram=0"), ({"min_ngram": 5}, "min_ngram=5"),
    ({"max_batch_tokens": 0}, "max_batch_tokens=0"), ({"max_batch_tokens": "8"}, "max_batch_tokens='8'"),
    # A scheme whose assumptions the drafts do not meet (see tests/engine/test_configurations.py).
    ({"drafter": "ngram", "scheme": "spectr"}, "scheme='spectr' needs the distribution q"),
    ({"drafter": "consensus", "scheme": "specinfer"}, "scheme='specinfer' needs the distribution q"),
    ({"drafter": "ngram", "sampled_drafts": True}, "drafter='ngram' copies text"),
    ({"drafter": "consensus", "sampled_drafts": True, "scheme": "without_replacement", "max_draft_nodes": 12,
      "max_draft_tokens": 3}, "without replacement, but drafter 'consensus' draws them i.i.d."),
    ({"drafter": "consensus", "sampled_drafts": True, "scheme": "single", "max_draft_nodes": 12}, "at most 1 child"),
]


@pytest.mark.parametrize("options,needle", SPEC_BAD)
def test_spec_config_names_the_field_and_why(options, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SpecConfig(**options)


def test_sampled_drafts_none_is_each_drafters_own_way():
    """``sampled_drafts=None`` (the default): consensus and prompt lookup copy their drafts, the
    hybrid draws its head's candidates (the mixed law, verified by recursive rejection); an
    explicit value overrides, and the command line's ``--sampled-drafts`` / ``--no-sampled-drafts``
    give True / False (neither: None)."""
    from multispec.cli import _spec, build_parser

    assert [SpecConfig(drafter=d).sampled for d in ("none", "consensus", "ngram", "hybrid")] == [False, False, False,
                                                                                                  True]
    assert SpecConfig(drafter="hybrid").draft_law.law == "mixed"
    assert SpecConfig(drafter="hybrid", sampled_drafts=False).draft_law.law == "copied"
    assert SpecConfig(drafter="consensus", sampled_drafts=True).sampled
    parser = build_parser()
    for flags, want in (([], None), (["--sampled-drafts"], True), (["--no-sampled-drafts"], False)):
        args = parser.parse_args(["generate", "--prompt", "x", "--drafter", "hybrid", *flags])
        assert _spec(args).sampled_drafts is want


def test_every_command_switches_prefix_caching(monkeypatch):
    """``--enable-prefix-caching`` (the default) and ``--no-enable-prefix-caching`` on every command
    that loads a model, passed on to the ``LLM`` it builds."""
    from multispec import api
    from multispec.cli import _llm, build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["gsm8k"], ["eval", "--task", "gsm8k"],
                    ["batch", "--input", "a", "--output", "b"], ["serve"]):
        assert parser.parse_args(command).enable_prefix_caching is True
        assert parser.parse_args([*command, "--no-enable-prefix-caching"]).enable_prefix_caching is False
    built = {}
    monkeypatch.setattr(api.LLM, "__init__", lambda self, *a, **options: built.update(options))
    monkeypatch.setattr(api.LLM, "dtype", "float32", raising=False)
    monkeypatch.setattr(api.LLM, "kv_cache_dtype", "float32", raising=False)
    monkeypatch.setattr(api.LLM, "device", "cpu", raising=False)
    _llm(parser.parse_args(["generate", "--prompt", "x", "--no-enable-prefix-caching"]))
    assert built["enable_prefix_caching"] is False


def test_spec_config_checks_the_scheme_against_the_temperature():
    spec = SpecConfig(scheme="greedy")  # exact at temperature 0 only
    spec.check_temperature(0.0)
    with pytest.raises(ValueError, match="scheme='greedy' is exact only at temperature 0"):
        spec.check_temperature(1.0)


LLM_BAD = [
    ({"model": None}, "model=None"), ({"model": 5}, "model=5"), ({"model": "no-such-model"}, "no-such-model"),
    ({"model": "/tmp/definitely/missing.gguf"}, "missing.gguf"),
    ({"dtype": "int8"}, "dtype='int8'"), ({"dtype": None}, "dtype=None"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8': must be one of auto, float32, bfloat16"),
    ({"kv_cache_dtype": None}, "kv_cache_dtype=None"),
    ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, "kv_cache_dtype='float32': under bfloat16 weights"),
    ({"kv_cache_memory": "4"}, "kv_cache_memory='4'"), ({"kv_cache_memory": 0}, "kv_cache_memory=0"),
    ({"kv_cache_memory": math.inf}, "kv_cache_memory=inf"), ({"kv_cache_memory": True}, "kv_cache_memory=True"),
    ({"max_model_len": "100"}, "max_model_len='100'"), ({"max_model_len": 1.5}, "max_model_len=1.5"),
    ({"spec": "consensus"}, "spec='consensus'"), ({"spec": {"drafter": "consensus"}}, "spec={"),
    ({"cache_dir": 5}, "cache_dir=5"), ({"device": "tpu"}, "device='tpu'"), ({"device": "cuda:99"}, "device='cuda:99'"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching='yes'"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching=1"),
]


@pytest.mark.parametrize("options,needle", LLM_BAD)
def test_llm_refuses_bad_arguments_before_loading(options, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        LLM(**options)


def test_llm_refuses_a_context_window_the_model_lacks(successor_dir):
    for bad in (1, 257):
        with pytest.raises(ValueError, match=re.escape(f"max_model_len={bad}")):
            LLM(str(successor_dir), max_model_len=bad, device="cpu")


def test_a_request_that_can_never_fit_the_cache_is_refused_before_it_runs(successor_dir):
    small = LLM(str(successor_dir), device="cpu", kv_cache_memory=0.0005)  # about 1,000 tokens
    with pytest.raises(ValueError, match="kv_cache_memory"):
        small.generate([[5, 6]], SamplingParams(n=64, max_tokens=100))
    assert small.last_stats is None and not small.engine.has_unfinished_requests()


GENERATE_BAD = [
    ({"prompts": None}, "prompts=None"), ({"prompts": 5}, "prompts=5"), ({"prompts": []}, "prompts is empty"),
    ({"prompts": ""}, "prompt 0 is empty"), ({"prompts": [[]]}, "prompt 0 is empty"),
    ({"prompts": [[1, "a"]]}, "prompt 0 must be"), ({"prompts": [1.5]}, "prompt 0 must be"),
    ({"prompts": [[True, 2]]}, "prompt 0 must be"), ({"prompts": [[500]]}, "token ids outside [0, 400)"),
    ({"prompts": [[1] * 300]}, "context window"),
    ({"prompts": {"prompt": "hi", "prompt_token_ids": [5]}}, "exactly one of 'prompt' and 'prompt_token_ids'"),
    ({"prompts": [{}]}, "exactly one of"), ({"prompts": [{"prompt": ""}]}, "'prompt' must be a non-empty string"),
    ({"prompts": [{"prompt_token_ids": [5, 2.0]}]}, "'prompt_token_ids' must be a non-empty list of token ids"),
    ({"prompts": [{"prompt_token_ids": [5], "multi_modal_data": {}}]}, "unsupported key(s) 'multi_modal_data'"),
    ({"prompts": [{"prompt_token_ids": [500]}]}, "token ids outside [0, 400)"),
    ({"sampling_params": {"n": 2}}, "sampling_params={"), ({"sampling_params": "x"}, "sampling_params='x'"),
    ({"sampling_params": [SamplingParams(), "x"]}, "sampling_params=["),
    ({"sampling_params": [SamplingParams(), SamplingParams()]}, "sampling_params has 2 entries for 1 prompts"),
    ({"sampling_params": SamplingParams(logprobs=401)}, "logprobs=401"),
    ({"sampling_params": SamplingParams(stop_token_ids=[400])}, "stop_token_ids=[400]"),
    ({"sampling_params": SamplingParams(allowed_token_ids=[3, 400])}, "allowed_token_ids=[3, 400]"),
    ({"sampling_params": SamplingParams(logit_bias={400: 1.0})}, "logit_bias={400: 1.0}"),
    ({"sampling_params": SamplingParams(allowed_token_ids=[3], stop_token_ids=[3], min_tokens=1)},
     "allowed_token_ids=[3]: with min_tokens=1"),
    ({"sampling_params": SamplingParams(structured_outputs={"grammar": "start: <|nope|>"})},
     'structured_outputs.grammar: at 1(8): unknown special token: "<|nope|>"'),  # the vocabulary's, at the request
    ({"sampling_params": SamplingParams(structured_outputs={"grammar": "start: <[400]>"})},
     "structured_outputs.grammar: at 1(8): Token range end too large: 400"),
    ({"spec": "consensus"}, "spec='consensus'"),
    ({"spec": SpecConfig(scheme="greedy")}, "scheme='greedy' is exact only at temperature 0"),
    ({"use_tqdm": "no"}, "use_tqdm='no'"),
]


@pytest.mark.parametrize("options,needle", GENERATE_BAD)
def test_generate_refuses_bad_input_before_any_work(tiny, options, needle):
    call = {"prompts": [[5, 6, 7]], "sampling_params": SamplingParams(), **options}
    before = tiny.last_stats
    with pytest.raises(ValueError, match=re.escape(needle)):
        tiny.generate(**call)
    assert tiny.last_stats is before


def test_vllm_dict_prompts_are_the_same_requests_as_text_and_ids(tiny):
    params = SamplingParams(n=2, max_tokens=4, seed=3)
    text = "hello world"
    ids = tiny.get_tokenizer().encode(text)
    by_text, by_ids = tiny.generate([text, ids], params, use_tqdm=False)
    as_text, as_ids = tiny.generate([{"prompt": text}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    single = tiny.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert as_text.prompt == text and as_ids.prompt is None and as_ids.prompt_token_ids == ids
    for a, b in ((by_text, as_text), (by_ids, as_ids), (by_ids, single[0])):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_one_bad_request_refuses_the_whole_call(tiny):
    before = tiny.last_stats
    with pytest.raises(ValueError, match="logprobs=401"):
        tiny.generate([[5, 6], [7, 8], [9, 10]], [SamplingParams(), SamplingParams(), SamplingParams(logprobs=401)])
    assert tiny.last_stats is before


@pytest.mark.parametrize("speculate", [False, True])
def test_rules_that_leave_no_token_fail_their_request_alone(tiny, speculate, caplog):
    """A grammar that wants token 6 second and allowed tokens without it leave that position no
    token (no single rule can, and they are only known to clash there): the request fails with
    an error naming the position, its samples end "abort" after the one token they could take, and
    a request beside it gets the samples it gets alone; at the first position, the same."""
    spec = SpecConfig(drafter="consensus", adaptive=False) if speculate else SpecConfig()
    other = SamplingParams(n=3, max_tokens=6, seed=2, ignore_eos=True)
    alone = tiny.generate([[8, 9]], other, spec, use_tqdm=False)[0]
    for grammar, taken in (("start: <[5]> <[6]> <[7]>*", [5]), ("start: <[6]> <[7]>*", [])):
        clash = SamplingParams(n=2, max_tokens=6, seed=0, ignore_eos=True, allowed_token_ids=[5, 7],
                               structured_outputs={"grammar": grammar})
        failed, beside = tiny.generate([[5, 6, 7], [8, 9]], [clash, other], spec, use_tqdm=False)
        assert failed.error is not None and f"no token is allowed at output position {len(taken)}" in failed.error
        assert [c.token_ids for c in failed.outputs] == [taken, taken]
        assert {c.finish_reason for c in failed.outputs} == {"abort"}
        assert beside.error is None and [c.token_ids for c in beside.outputs] == [c.token_ids for c in alone.outputs]
    assert "no token is allowed" in caplog.text


def test_a_drafted_row_that_leaves_no_token_fails_its_request(tiny):
    """The row of an accepted draft node left no token: prompt lookup drafts 7 then 6 after 5 (the
    prompt holds 5 7 6), the grammar takes 7 for certain and then wants only 6, which the allowed
    tokens exclude, so the row after the accepted 7 is where the request fails (output position
    2), as plain decoding fails there; a check of the roots alone would draw from that row."""
    clash = SamplingParams(n=2, max_tokens=6, seed=0, ignore_eos=True, allowed_token_ids=[5, 7],
                           structured_outputs={"grammar": "start: <[5]> <[7]> <[6]> <[7]>*"})
    for spec in (SpecConfig(), SpecConfig(drafter="ngram", adaptive=False, max_draft_tokens=2)):
        out = tiny.generate([[5, 7, 6, 9, 5, 7, 6]], clash, spec, use_tqdm=False)[0]
        assert out.error is not None and "no token is allowed at output position 2" in out.error
        assert {c.finish_reason for c in out.outputs} == {"abort"}
        if spec.speculates:
            assert tiny.last_stats.accepted_tokens > 0


def test_max_tokens_past_the_context_window_is_clipped_as_vllm_does(tiny):
    """vLLM's offline LLM stops such samples at the context window with finish_reason "length"."""
    prompt = [5] * 250
    out = tiny.generate([prompt], SamplingParams(n=2, max_tokens=100, ignore_eos=True, seed=0), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [6, 6]
    assert {c.finish_reason for c in out.outputs} == {"length"}


def test_truncate_prompt_tokens_keeps_the_last_tokens_as_vllm_does(tiny):
    """k: the prompt's last k tokens, the same samples as that prompt given alone; -1: as many as
    the context window leaves room for, so a prompt longer than the window runs instead of being
    refused."""
    prompt = [(7 * i) % 300 + 5 for i in range(40)]
    sampling = SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=1)
    cut = tiny.generate([prompt], SamplingParams(**{**vars(sampling), "truncate_prompt_tokens": 6}), use_tqdm=False)[0]
    alone = tiny.generate([prompt[-6:]], sampling, use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-6:] and [c.token_ids for c in cut.outputs] == [
        c.token_ids for c in alone.outputs]
    long = [5] * 300
    with pytest.raises(ValueError, match="context window"):
        tiny.generate([long], sampling, use_tqdm=False)
    out = tiny.generate([long], SamplingParams(**{**vars(sampling), "truncate_prompt_tokens": -1}), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 255 and [len(c.token_ids) for c in out.outputs] == [1, 1, 1]


CHAT_BAD = [
    ("Hello", "messages='Hello'"), (None, "messages=None"), ([], "messages=[]"), ([{}], "message 0 must be"),
    ([{"role": "user"}], "message 0 must be"), ([{"role": "user", "content": 5}], "message 0 must be"),
    ([[{"role": "user", "content": "hi"}], "x"], "messages=["), ([[]], "conversation 0 is empty"),
]


@pytest.mark.parametrize("messages,needle", CHAT_BAD)
def test_chat_refuses_bad_messages(tiny, messages, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        tiny.chat(messages, SamplingParams())


CHAT_OPTIONS_BAD = [
    ({"chat_template": ""}, "chat_template=''"), ({"chat_template": 5}, "chat_template=5"),
    ({"chat_template": "{% if %}"}, "chat template does not parse"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt='yes'"),
    ({"continue_final_message": 1}, "continue_final_message=1"),
    ({"continue_final_message": True}, "continue_final_message=True needs add_generation_prompt=False"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs=[1]"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs: 'messages' is set by the chat call itself"),
    ({"tools": "f"}, "tools='f'"), ({"tools": [1]}, "tools=[1]"),
    ({"continue_final_message": True, "add_generation_prompt": False, "chat_template": "{{ 'fixed' }}"},
     "continue_final_message: the last message's content does not appear in the rendered chat"),
]


@pytest.mark.parametrize("options,needle", CHAT_OPTIONS_BAD)
def test_chat_refuses_bad_template_options(tiny, options, needle):
    before = tiny.last_stats
    with pytest.raises(ValueError, match=re.escape(needle)):
        tiny.chat([{"role": "user", "content": "hi"}], SamplingParams(), **options)
    assert tiny.last_stats is before


def test_chat_template_options_shape_the_prompt(tiny):
    """The prompt a chat call runs on is the template's rendering with the options (the same
    samples as that text given as a prompt): another template with a variable, and the last
    message continued."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ tail }}"
    params = SamplingParams(n=2, max_tokens=4, seed=1, ignore_eos=True)
    out = tiny.chat([{"role": "user", "content": "The quick"}], params, chat_template=template,
                    add_generation_prompt=False, chat_template_kwargs={"tail": "brown"}, use_tqdm=False)[0]
    assert out.prompt == "[user] The quick\nbrown"
    ids = tiny.tokenizer.encode(out.prompt, add_special_tokens=False)
    assert [c.token_ids for c in out.outputs] == [
        c.token_ids for c in tiny.generate([ids], params, use_tqdm=False)[0].outputs]
    continued = tiny.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The lazy"}], params,
                          add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert continued.prompt.endswith("The lazy")
    tool = {"type": "function", "function": {"name": "record", "parameters": {"type": "object"}}}
    listed = "{% for t in tools %}<{{ t.function.name }}>{% endfor %}{{ messages[0].content }}"
    out = tiny.chat([{"role": "user", "content": "hi"}], params, chat_template=listed, tools=[tool], use_tqdm=False)[0]
    assert out.prompt == "<record>hi"


CLI_BAD = [
    (["generate", "--prompt", "hi", "--n", "0"], "n=0"),
    (["generate", "--prompt", "hi", "--n", "abc"], "argument --n: invalid int value: 'abc'"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature=-1"),
    (["generate", "--prompt", "hi", "--temperature", "inf"], "temperature=inf"),
    (["generate", "--prompt", "hi", "--top-p", "2"], "top_p=2"),
    (["generate", "--prompt", "hi", "--top-k", "-3"], "top_k=-3"),
    (["generate", "--prompt", "hi", "--min-p", "2"], "min_p=2"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens=0"),
    (["generate", "--prompt", "hi", "--max-tokens", "4", "--min-tokens", "5"],
     "min_tokens=5: must be at most max_tokens=4"),
    (["generate", "--prompt", "hi", "--seed", str(2**64)], f"seed={2**64}"),
    (["generate", "--prompt", "hi", "--model", "no-such-model"], "no-such-model"),
    (["generate", "--prompt", "hi", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["generate", "--prompt", "hi", "--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8'"),
    (["generate", "--prompt", "hi", "--drafter", "oracle"], "argument --drafter: invalid choice: 'oracle'"),
    (["generate", "--prompt", "hi", "--kv-cache-memory", "0"], "kv_cache_memory=0"),
    (["generate", "--prompt", "hi", "--device", "tpu"], "device='tpu'"),
    (["generate", "--prompt", "hi", "--drafter", "ngram", "--scheme", "spectr"], "scheme='spectr'"),
    (["generate", "--prompt", "hi", "--drafter", "ngram", "--sampled-drafts"], "drafter='ngram'"),
    (["generate", "--prompt", "hi", "--scheme", "greedy"], "scheme='greedy' is exact only at temperature 0"),
    (["generate"], "--prompt"),
    (["generate", "--prompt", "hi", "--regex", "a+", "--choice", "a"],
     "--regex and --choice: give at most one of --json-schema, --json-object, --regex, --choice and --grammar"),
    (["generate", "--prompt", "hi", "--json-schema", "{type"], "--json-schema: neither a file nor JSON text"),
    (["generate", "--prompt", "hi", "--choice", ""], "structured_outputs.choice=['']"),
    (["generate", "--prompt", "hi", "--json-object", "--min-tokens", "2"], "min_tokens=2: cannot be combined"),
    (["generate", "--prompt", "hi", "--chat-template", "x"], "--chat-template and --chat-template-kwargs apply with --chat"),
    (["generate", "--prompt", "hi", "--chat", "--chat-template-kwargs", "{bad"], "--chat-template-kwargs: not valid JSON"),
    (["generate", "--prompt", "hi", "--chat", "--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["generate", "--prompts-file", "/tmp/definitely/nope.txt"], "nope.txt"),
    (["gsm8k", "--offset", "100000"], "offset=100000"),
    (["gsm8k", "--questions", "0"], "--questions=0"),
    (["analyze-verify", "--random-vocab", "0"], "--random-vocab=0"),
    (["analyze-verify", "--max-drafts", "0"], "--max-drafts=0"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
]


@pytest.mark.parametrize("argv,needle", CLI_BAD, ids=[" ".join(a)[:60] for a, _ in CLI_BAD])
def test_cli_reports_one_line_and_exits_2(capsys, argv, needle):
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_cli_error_in_a_fresh_process_has_no_traceback():
    result = subprocess.run([sys.executable, "-m", "multispec.cli", "generate", "--prompt", "hi", "--drafter", "ngram",
                             "--scheme", "spectr"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_model_and_missing_file():
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="missing.gguf"):
        resolve_model("/tmp/definitely/missing.gguf")
