"""The `specdec` command line: JSON output, streaming, and exit code 2 on bad input."""

import json
import subprocess
import sys

import pytest

from specdec.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_installed_entry_point(tiny_llama, tiny_llama_draft):
    proc = subprocess.run(
        ["specdec", "generate", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "-k", "3",
         "--max-tokens", "20", "--json", "w5 w6 w7 w8"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "token_ids", "finish_reason", "usage", "speculative"}
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": len(out["token_ids"]),
                            "total_tokens": 4 + len(out["token_ids"]),
                            "prompt_tokens_details": {"cached_tokens": 0}}  # a fresh process caches nothing
    spec = out["speculative"]
    assert set(spec) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                         "mean_accepted_length", "accepted_per_position", "target_forwards"}
    assert len(spec["accepted_per_position"]) == 3
    assert spec["num_accepted_tokens"] == sum(spec["accepted_per_position"])
    assert 0 <= spec["acceptance_rate"] <= 1


def test_missing_model_exits_2(tmp_path):
    proc = run_cli("generate", "--target", str(tmp_path / "missing"), "hello")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_streaming_prints_text_and_summary(tiny_llama, capsys):
    assert main(["generate", "--target", str(tiny_llama), "--draft", "ngram", "--max-tokens", "12", "w1 w2 w3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().startswith("w")
    assert "tok/s" in captured.err and "tokens/target forward" in captured.err


def test_json_matches_python_api(tiny_llama, capsys):
    from specdec import SamplingParams, SpeculativeEngine

    assert main(["generate", "--target", str(tiny_llama), "--draft", "ngram", "--max-tokens", "16", "--json",
                 "w1 w2 w3"]) == 0
    cli_out = json.loads(capsys.readouterr().out)
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft="ngram")
    assert cli_out["token_ids"] == engine.generate("w1 w2 w3", sampling=SamplingParams(max_tokens=16)).token_ids


def test_penalties_and_logprobs_from_the_command_line(tiny_llama, capsys):
    from specdec import SamplingParams, SpeculativeEngine

    assert main(["generate", "--target", str(tiny_llama), "--draft", "ngram", "--max-tokens", "12", "--json",
                 "--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--logit-bias", "7=3",
                 "--logprobs", "2", "w1 w2 w3"]) == 0
    cli_out = json.loads(capsys.readouterr().out)
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft="ngram")
    expected = engine.generate("w1 w2 w3", sampling=SamplingParams(
        max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 3.0}, logprobs=2))
    assert cli_out["token_ids"] == expected.token_ids
    assert [e["logprob"] for e in cli_out["logprobs"]] == pytest.approx([e.logprob for e in expected.logprobs])
    assert all(len(e["top_logprobs"]) == 2 for e in cli_out["logprobs"])


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature must be"),  # the flag, not the field
    (["--top-p", "0"], "--top-p must be"),
    (["--top-p", "1.1"], "--top-p must be"),
    (["--top-k", "-2"], "--top-k must be"),
    (["--max-tokens", "0"], "--max-tokens must be"),
    (["-k", "0"], "--num-speculative-tokens must be"),
    (["--max-tokens", "600"], "exceeds the model's context"),
    (["--chat"], "no chat template"),
    (["--presence-penalty", "3"], "--presence-penalty must be"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be"),
    (["--logit-bias", "5"], "--logit-bias"),
    (["--logit-bias", "5=200"], "--logit-bias must be a number in [-100, 100]"),
    (["--logit-bias", "500=1"], "logit_bias"),
    (["--logprobs", "21"], "--logprobs must be"),
    (["--regex", "(unclosed"], "--regex"),
    (["--json-schema", '{"type": "objekt"}'], "--json-schema"),
    (["--grammar", "/no/such/file.lark"], "--grammar"),
    (["--json-object"], "structured output is not available"),  # a word-level tokenizer
    (["--min-tokens", "300"], "--min-tokens (300) must not exceed max_tokens"),
])
def test_bad_options_exit_2(tiny_llama, capsys, args, message):
    assert _exit_code(["generate", "--target", str(tiny_llama), *args, "w1 w2"]) == 2
    assert message in capsys.readouterr().err


def _exit_code(argv) -> int:
    """main()'s exit code: argparse exits for what it parses (not an integer, not a choice), the
    config's checks return 2 (a value out of range); both are usage errors."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("flag", ["--draft-vocab-size", "--max-speculative-tokens", "--num-threads"])
def test_a_zero_where_a_positive_integer_is_needed_exits_2(tiny_llama, capsys, flag):
    assert _exit_code(["generate", "--target", str(tiny_llama), flag, "0", "w1"]) == 2
    assert f"{flag} must be an integer >= 1" in capsys.readouterr().err


def test_bad_k_syntax_exits_2(tiny_llama, capsys):
    assert _exit_code(["generate", "--target", str(tiny_llama), "-k", "lots", "w1"]) == 2
    assert "expected an integer >= 1 or 'auto'" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--prompt-lookup-min", "-1"], ["--draft-precision", "int3"],
                                  ["--draft-vocab-size", "x"]])
def test_bad_draft_lever_syntax_exits_2(tiny_llama, capsys, args):
    assert _exit_code(["generate", "--target", str(tiny_llama), *args, "w1"]) == 2
    assert args[0] in capsys.readouterr().err


def test_draft_levers_from_the_command_line(tiny_llama, tiny_llama_draft, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    base = ["generate", "--target", str(tiny_llama), "--max-tokens", "24", "--json", "w5 w6 w7 w5 w6 w7 w5"]
    assert main([*base, "--draft", "none"]) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*base, "--draft", str(tiny_llama_draft), "--draft-precision", "int8-weight", "--draft-vocab-size",
                 "50", "--prompt-lookup-min", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == expected and out["speculative"]["num_draft_tokens"] > 0


def test_empty_prompt_exits_2(tiny_llama, capsys):
    assert main(["generate", "--target", str(tiny_llama), "  "]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_mismatched_tokenizers_exit_2(tiny_llama, tiny_other_vocab, capsys):
    assert main(["generate", "--target", str(tiny_llama), "--draft", str(tiny_other_vocab), "w1"]) == 2
    assert "do not share a tokenizer" in capsys.readouterr().err


def test_prompt_from_stdin(tiny_llama, monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2 w3"))
    assert main(["generate", "--target", str(tiny_llama), "--max-tokens", "4", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["usage"]["prompt_tokens"] == 3


def test_seeded_sampling_from_the_command_line_is_the_target_only_text(tiny_llama, tiny_llama_draft, capsys):
    base = ["generate", "--target", str(tiny_llama), "--max-tokens", "24", "--json", "--temperature", "0.8",
            "--top-k", "20", "--seed", "5", "--ignore-eos", "w5 w6 w7"]
    assert main([*base, "--draft", "none"]) == 0
    target_only = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*base, "--draft", str(tiny_llama_draft), "-k", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == target_only and out["speculative"]["num_draft_tokens"] > 0
    assert main([*base, "--draft", str(tiny_llama_draft), "--speculative-sampling", "residual"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 24
    with pytest.raises(SystemExit) as e:
        main([*base, "--speculative-sampling", "exact"])
    assert e.value.code == 2 and "--speculative-sampling" in capsys.readouterr().err


def test_generate_with_a_json_schema_and_a_choice(tiny_bpe_pair, capsys):
    from specdec import SamplingParams, SpeculativeEngine
    from specdec.constraint import Constraint

    target, draft = tiny_bpe_pair
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--max-tokens", "40", "--json",
                 "--json-schema", json.dumps(schema), "Give n:"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith('{"n": ')
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft))
    assert out["token_ids"] == engine.generate("Give n:", sampling=SamplingParams(
        max_tokens=40, structured=Constraint("json_schema", json.dumps(schema)))).token_ids
    assert main(["generate", "--target", str(target), "--json", "--choice", "yes", "--choice", "no", "Ok?"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
