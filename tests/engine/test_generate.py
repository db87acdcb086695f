"""End-to-end plain decoding with the default model: parity, batching, seeds, limits, stops."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from multispec import SamplingParams, SpecConfig
from multispec.engine.costs import StepCosts


@pytest.fixture(scope="module")
def hf_model(llm):
    """transformers' own Llama on the very same weights, for reference decoding."""
    hf_config = transformers.LlamaConfig(
        vocab_size=llm.config.vocab_size, hidden_size=llm.config.hidden_size,
        intermediate_size=llm.config.intermediate_size, num_hidden_layers=llm.config.num_hidden_layers,
        num_attention_heads=llm.config.num_attention_heads, num_key_value_heads=llm.config.num_key_value_heads,
        max_position_embeddings=llm.config.max_position_embeddings, rms_norm_eps=llm.config.rms_norm_eps,
        rope_theta=llm.config.rope_theta, tie_word_embeddings=llm.config.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(llm.model.state_dict(), strict=False)
    model.tie_weights()
    return model


def test_greedy_matches_transformers_generate(llm, hf_model):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outputs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.no_grad():
            want = hf_model.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24)[0, ids.shape[1]:]
        for completion in out.outputs:
            assert completion.token_ids == want.tolist()
            assert completion.finish_reason == "length"


def test_cumulative_logprob_is_the_models_sequence_logprob(llm, hf_model):
    prompt = "Once upon a time"
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0.8, max_tokens=12, seed=3, logprobs=2))[0]
    ids = llm.tokenizer.encode(prompt)
    for completion in out.outputs:
        full = torch.tensor([ids + completion.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(full).logits[0, len(ids) - 1:-1].float(), -1)
        want = logp.gather(1, torch.tensor(completion.token_ids)[:, None]).sum().item()
        assert completion.cumulative_logprob == pytest.approx(want, abs=1e-2)
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and 2 <= len(entry) <= 3
        assert sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs)) == pytest.approx(
            completion.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_prompt_logprobs_are_the_models(llm, hf_model, monkeypatch, path):
    """Each prompt token's log-probability given the tokens before it, with the top 3, against
    transformers on the same weights; the first token has none. Two prompts in one prefill, the
    head run on 4 rows at a time so that the chunks' seams are crossed; through the compiled
    kernel (where built) and through torch's operators (a GPU's path)."""
    monkeypatch.setattr("multispec.engine.engine.PROMPT_LOGPROB_ROWS", 4)
    if path == "torch":
        monkeypatch.setattr("multispec.kernels.token_logprobs", lambda: None)
    prompts = ["The quick brown fox jumps over the lazy dog", "Once upon a time"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position, (token, entry) in enumerate(zip(ids[1:], out.prompt_logprobs[1:])):
            top = logp[position].topk(3).indices.tolist()
            assert set(entry) == set(top) | {token}
            assert entry[token] == pytest.approx(logp[position, token].item(), abs=1e-3)
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prompt_is_prefilled_once_for_all_samples(llm):
    prompt = "Write a short poem about the sea."
    llm.generate(prompt, SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=0))
    stats = llm.last_stats
    assert stats.prefill_forwards == 1
    assert stats.prompt_tokens == len(llm.tokenizer.encode(prompt))


def test_samples_leave_the_batch_when_they_finish(llm):
    """Plain decoding gives each live sample one token per forward, so the sample-steps count is
    exactly the tokens after the first; finished samples would inflate it if they stayed."""
    out = llm.generate(["Hi", "List three colors:"], [SamplingParams(n=5, temperature=1.0, max_tokens=30, seed=1),
                                                       SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=2)])
    lengths = [len(c.token_ids) for o in out for c in o.outputs]
    assert [len(o.outputs) for o in out] == [5, 3]
    assert llm.last_stats.sample_steps == sum(n - 1 for n in lengths)
    assert llm.last_stats.prefill_forwards == 1  # both prompts share one prefill forward
    assert all(len(c.token_ids) <= 10 for c in out[1].outputs)


def test_same_seed_same_outputs_different_seed_differs(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=123)
    a = llm.generate("Tell me a story.", params)[0]
    b = llm.generate("Tell me a story.", params)[0]
    c = llm.generate("Tell me a story.", SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=124))[0]
    assert [x.token_ids for x in a.outputs] == [x.token_ids for x in b.outputs]
    assert [x.token_ids for x in a.outputs] != [x.token_ids for x in c.outputs]


def test_stop_string_and_stop_token(llm):
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(n=1, temperature=0, max_tokens=30, stop=[" 5"]))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and " 5" not in completion.text
    first = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first[1]]))
    assert out[0].outputs[0].token_ids == first[:2] and out[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("stop", [(), (" never",)], ids=["whole-text", "streamed-text"])
def test_the_stop_token_text_is_left_out_as_vllm_does(llm, stop):
    """As in vLLM, the stop token that ends a sample (an end of sequence, or one of
    ``stop_token_ids``) counts among its tokens but not in its text, unless
    ``include_stop_str_in_output``; so ``skip_special_tokens=False`` shows no end-of-sequence text.
    Both ways the text is made: decoded at the end, and as tokens arrive (stop strings need that)."""
    prompt = "Count: 1, 2, 3,"
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    for include in (False, True):
        law = dict(temperature=0, max_tokens=30, stop=list(stop), include_stop_str_in_output=include)
        out = llm.generate(prompt, SamplingParams(stop_token_ids=[first[1]], **law))[0].outputs[0]
        assert out.token_ids == first[:2] and out.stop_reason == first[1]
        assert out.text == llm.tokenizer.decode(first[:2] if include else first[:1])
        chat = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(  # the choice ends it with an EOS
            skip_special_tokens=False, structured_outputs={"choice": ["hi"]}, **law))
        out = chat[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.tokenizer.eos_token_ids
        assert out.text == llm.tokenizer.decode(out.token_ids if include else out.token_ids[:-1],
                                                skip_special_tokens=False)


def test_min_tokens_holds_back_stop_tokens_and_strings(llm):
    """As in vLLM: before a sample has ``min_tokens`` tokens its stop tokens get no probability (so
    greedy takes the next likeliest token) and stop strings are not looked for; after, both stop."""
    prompt = "Count: 1, 2, 3,"
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert first.text.count(",") >= 3
    for at in (0, 1):  # the prompt's row, then a step's
        held = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first.token_ids[at]], min_tokens=at + 1)
        for spec in (None, SpecConfig(drafter="ngram", adaptive=False)):
            out = llm.generate(prompt, held, spec)[0].outputs[0]
            assert out.token_ids[:at] == first.token_ids[:at] and out.token_ids[at] != first.token_ids[at]
            assert first.token_ids[at] not in out.token_ids[:at + 1] and len(out.token_ids) > at + 1
    # The first comma completes at token k: with min_tokens = k the stop string waits for the next one.
    k = next(i for i in range(1, 31) if "," in llm.tokenizer.decode(first.token_ids[:i]))
    at = len(llm.tokenizer.decode(first.token_ids[:k]))
    for spec in (None, SpecConfig(drafter="ngram", adaptive=False)):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[","], min_tokens=k), spec)[0]
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and completion.text == first.text[:first.text.index(",", at)]


def test_bad_words_are_never_completed(llm):
    """vLLM's bad words: greedy "Count: 1, 2, 3," runs " 4, 5, 6, 7, ..."; with the bad word "6, 7"
    (tokens 6 , space 7) the 7 after "6, " gets no probability and greedy takes the next likeliest,
    the rest as plain; a one-token word never appears. Drafted steps (n-gram, which would copy the
    counting, and seeded sampled consensus) give the plain samples, so each draft row is ruled by
    its own path."""
    prompt = "Count: 1, 2, 3,"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    word = llm.engine._bad_words_ids(["6, 7"])
    assert word and all(len(ids) == 4 for ids in word)
    banned = next(i for i in range(len(plain.token_ids)) if plain.token_ids[i - 3:i + 1] in word)
    for spec in (None, SpecConfig(drafter="ngram", adaptive=False)):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, bad_words=["6, 7"]), spec)[0].outputs[0]
        ids = out.token_ids
        assert ids[:banned] == plain.token_ids[:banned] and ids[banned] != plain.token_ids[banned]
        assert not any(ids[i:i + 4] in word for i in range(len(ids)))
    seven = llm.tokenizer.encode("7", add_special_tokens=False)
    sampled = SamplingParams(n=8, temperature=0.8, max_tokens=24, seed=2, bad_words=["7"])
    outs = []
    for spec in (None, SpecConfig(drafter="consensus", adaptive=False)):
        outs.append(llm.generate(prompt, sampled, spec)[0].outputs)
        assert spec is None or llm.last_stats.accepted_tokens > 0
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    assert len(seven) == 1 and not any(seven[0] in c.token_ids for c in outs[0])


ANSWER_SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 120},
                                                 "answer": {"type": "integer"}},
                 "required": ["reasoning", "answer"], "additionalProperties": False}


def test_structured_outputs_on_a_real_model(llm):
    """A JSON schema, a choice and a regex on the default model: every answer that ends parses and
    follows its constraint, with plain decoding, sibling drafts and the hybrid's drawn ones; seeded
    copied drafts give the seeded plain samples, so a drafted row is masked by its own path."""
    question = [{"role": "user", "content": "A farmer has 3 pens with 12 hens each. How many hens? Answer in JSON."}]
    json_law = SamplingParams(n=6, temperature=0.8, max_tokens=96, seed=4, structured_outputs={"json": ANSWER_SCHEMA})
    outs = {}
    for name, spec in (("plain", None), ("consensus", SpecConfig(drafter="consensus", adaptive=False)),
                       ("hybrid", SpecConfig(drafter="hybrid", adaptive=False))):
        outs[name] = llm.chat(question, json_law, spec)[0].outputs
        if spec is not None:
            assert llm.last_stats.accepted_tokens > 0
        for completion in outs[name]:
            if completion.finish_reason == "stop":
                answer = json.loads(completion.text)
                assert set(answer) == {"reasoning", "answer"} and isinstance(answer["answer"], int)
                assert len(answer["reasoning"]) <= 120
    assert sum(c.finish_reason == "stop" for c in outs["plain"]) >= 3
    assert [c.token_ids for c in outs["consensus"]] == [c.token_ids for c in outs["plain"]]
    choice = SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=1,
                            structured_outputs={"choice": ["Paris", "Lyon", "Marseille"]})
    regex = SamplingParams(n=8, temperature=1.0, max_tokens=24, seed=1,
                           structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"})
    for spec in (None, SpecConfig(drafter="consensus", adaptive=False)):
        cities = llm.generate("The capital of France is", choice, spec)[0].outputs
        assert all(c.finish_reason == "stop" and c.text in ("Paris", "Lyon", "Marseille") for c in cities)
        phones = llm.generate("Call me at", regex, spec)[0].outputs
        assert all(c.finish_reason == "stop" and re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text) for c in phones)


def test_min_tokens_holds_back_the_end_of_a_chat_answer(llm):
    chat = [{"role": "user", "content": "Say hello."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 40
    held = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=64, min_tokens=len(short.token_ids) + 8)
    for spec in (None, SpecConfig()):
        for completion in llm.chat(chat, held, spec)[0].outputs:
            assert len(completion.token_ids) >= held.min_tokens
            assert not set(completion.token_ids[:held.min_tokens]) & set(llm.tokenizer.eos_token_ids)


def test_eos_stops_a_chat_answer(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(n=2, temperature=0, max_tokens=64))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in llm.tokenizer.eos_token_ids
    # skip_special_tokens=False with include_stop_str_in_output: the text keeps the end's own text,
    # decoded at the end or as tokens arrive (without it, vLLM leaves the stop token's text out)
    end = llm.tokenizer.decode(completion.token_ids[-1:], skip_special_tokens=False)
    assert end and not completion.text.endswith(end)
    for stop in (None, ["no such text"]):
        kept = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(
            temperature=0, max_tokens=64, skip_special_tokens=False, stop=stop, include_stop_str_in_output=True))[0]
        assert kept.outputs[0].text == completion.text + end


def test_include_stop_str_in_output(llm):
    params = SamplingParams(temperature=0, max_tokens=30, stop=[" 5"], include_stop_str_in_output=True)
    kept = llm.generate("Count: 1, 2, 3,", params)[0].outputs[0]
    cut = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=30, stop=[" 5"]))[0].outputs[0]
    assert kept.finish_reason == "stop" and kept.stop_reason == " 5" and kept.text == cut.text + " 5"


def test_first_token_distribution_is_the_models(llm):
    """Chi-square of 4000 first tokens against the model's own next-token distribution (top 10
    tokens + the rest as one cell). At alpha = 1e-3 it catches a 5% total-variation error in the
    sampler with power > 0.99."""
    from scipy.stats import chisquare

    prompt = "My favourite animal is the"
    n = 4000
    out = llm.generate(prompt, SamplingParams(n=n, temperature=1.0, max_tokens=1, seed=11))[0]
    ids = torch.tensor(llm.tokenizer.encode(prompt))
    from tests.helpers import new_cache, prefill

    with torch.inference_mode():
        probs = torch.softmax(prefill(llm.model, new_cache(llm.model), ids.tolist())[-1], -1)
    top = probs.topk(10).indices.tolist()
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=probs.numel())
    observed = [int(counts[t]) for t in top] + [n - int(counts[top].sum())]
    expected = [float(probs[t]) for t in top] + [1 - float(probs[top].sum())]
    expected = [e * n / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_draft_calibration_outlives_a_call(llm, monkeypatch):
    """The engine keeps what verification showed of a drafter's drafts, per sampling setting (a
    lane), so a request sent on its own does not start again from the drafter's raw confidence."""
    spec = SpecConfig(drafter="consensus")
    params = SamplingParams(n=4, temperature=0.7, max_tokens=24, seed=0)
    llm.engine.lanes.clear()
    # Overhead-bound prices (a step of 1 to 64 tokens costs about the same), so that the budget
    # drafts whatever this machine measured and there is acceptance to calibrate.
    monkeypatch.setattr(llm.engine, "_step_costs", StepCosts([1, 64], [0.05, 0.052], 0.0, [1], [0.0]))
    monkeypatch.setattr(llm.engine, "_prices", None)
    llm.generate("Count: 1, 2, 3, 4, 5,", params, spec, use_tqdm=False)
    (key, lane), = llm.engine.lanes.items()
    seen = sum(map(sum, lane.budget.cal_tried))
    llm.generate("Count: 10, 20, 30, 40,", params, spec, use_tqdm=False)
    assert list(llm.engine.lanes) == [key] and sum(map(sum, lane.budget.cal_tried)) > seen
    llm.generate("Count: 1, 2, 3,", SamplingParams(n=4, temperature=0, max_tokens=8), spec, use_tqdm=False)
    assert len(llm.engine.lanes) == 2  # greedy acceptance is calibrated on its own
    llm.engine.lanes.clear()  # their budgets hold the prices above


def test_text_decoded_at_the_end_leaves_an_unfinished_character_out(tiny):
    """A sample cut inside a multi-byte character: its text decoded once at the end (no stop
    strings, final outputs only) is the text made as tokens arrive (with a stop string, or
    streamed, as the server's), which leaves the unfinished character out as vLLM's detokenizer
    does, rather than showing U+FFFD."""
    chat = [{"role": "user", "content": "The quick brown fox"}]
    settings = dict(n=2, temperature=1.0, seed=4, max_tokens=12)
    final = tiny.chat(chat, SamplingParams(**settings), use_tqdm=False)[0].outputs
    arriving = tiny.chat(chat, SamplingParams(stop=["never in this text"], **settings), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in arriving] == [c.token_ids for c in final]
    assert any(tiny.tokenizer.decode(c.token_ids).endswith("\ufffd") for c in final), "pick another seed"
    assert [c.text for c in final] == [c.text for c in arriving]
    assert not any(c.text.endswith("\ufffd") for c in final)
