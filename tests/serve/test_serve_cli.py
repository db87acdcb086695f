"""``multispec serve``'s arguments: the model positionally or by --model, bad limits refused in
one line before anything loads."""

from __future__ import annotations

from multispec.cli import DEFAULT_MODEL, build_parser, main


def test_model_is_positional_or_by_flag_with_consensus_by_default():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert args.model_name is None and args.model == DEFAULT_MODEL and args.drafter == "consensus"
    assert (args.host, args.port, args.max_n) == ("127.0.0.1", 8000, 64)
    assert parser.parse_args(["serve", "some/dir", "--port", "9000"]).model_name == "some/dir"


def test_conflicting_models_and_bad_limits_are_one_line_errors(capsys):
    assert main(["serve", "a", "--model", "b"]) == 2
    assert main(["serve", "--max-n", "0"]) == 2
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["multispec: error: the model is named twice: 'a' and --model 'b'",
                     "multispec: error: --max-n=0: must be >= 1",
                     "multispec: error: --enable-auto-tool-choice needs --tool-call-parser "
                     "(hermes, llama3_json, mistral)"]


def test_a_chat_template_that_does_not_render_is_refused_before_serving(successor_dir, capsys):
    """``--chat-template`` (a file or the text) is rendered once on a one-message chat before the
    server starts: a broken one is one line and exit 2, never a 400 on every chat request."""
    assert main(["serve", str(successor_dir), "--device", "cpu", "--drafter", "none", "--chat-template",
                 "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multispec: error: chat template does not parse")


def test_seed_reaches_the_engine(monkeypatch, capsys):
    """``--seed`` (vLLM's) becomes ``LLM(seed=)``: requests that give no seed are seeded from it;
    ``--tokenizer`` and ``--revision`` reach the ``LLM`` likewise."""
    import multispec.api

    seen = {}

    def fake_llm(model, **options):
        seen.update(options)
        raise ValueError("not loading here")

    monkeypatch.setattr(multispec.api, "LLM", fake_llm)  # the command imports it when it runs
    assert main(["serve", "--seed", "5", "--tokenizer", "some/dir", "--revision", "v1"]) == 2
    assert (seen["seed"], seen["tokenizer"], seen["revision"]) == (5, "some/dir", "v1")
    assert capsys.readouterr().err.strip() == "multispec: error: not loading here"
