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
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["multispec: error: the model is named twice: 'a' and --model 'b'",
                     "multispec: error: --max-n=0: must be >= 1"]
