"""`specdec generate --tp N`: the Ray engine from the command line returns the in-process tokens."""

import json

import pytest

from specdec import SamplingParams, SpeculativeEngine
from specdec.cli import main


PROMPT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def in_process_tokens(tiny_llama, tiny_llama_draft) -> list[int]:
    local = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft))
    return local.generate(PROMPT, sampling=SamplingParams(max_tokens=24)).token_ids


@pytest.mark.parametrize("extra", [[], ["--draft-placement", "separate"], ["--draft-placement", "separate", "--no-pipeline"]],
                         ids=["auto", "separate-pipeline", "separate-no-pipeline"])
def test_generate_tp2_json_equals_in_process(ray_session, tiny_llama, tiny_llama_draft, in_process_tokens, capsys,
                                             extra):
    args = ["generate", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--tp", "2",
            "--max-tokens", "24", "--json", *extra, PROMPT]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == in_process_tokens
    assert out["speculative"]["num_draft_tokens"] > 0


def test_tp_that_does_not_divide_the_heads_exits_2(ray_session, tiny_llama, capsys):
    """Refused from the target's config, before resources are reserved or any shard starts."""
    # tiny_llama has 4 attention heads and 2 KV heads
    assert main(["generate", "--target", str(tiny_llama), "--draft", "ngram", "--tp", "3", "w1"]) == 2
    assert "tensor parallel size 3 does not divide the target's num_attention_heads=4" in capsys.readouterr().err


def test_bad_tp_exits_2(tiny_llama, capsys):
    assert main(["generate", "--target", str(tiny_llama), "--tp", "0", "w1"]) == 2
    assert "tp must be" in capsys.readouterr().err
