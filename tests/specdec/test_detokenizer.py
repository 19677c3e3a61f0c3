"""The incremental detokenizer with a real byte-level BPE tokenizer (SmolLM2's): characters split over
several tokens (emoji, CJK, accented letters) are held back until whole, never streamed as U+FFFD,
and the streamed pieces add up to the tokenizer's own decode of the whole output."""

from __future__ import annotations

import pytest

from specdec.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["naïve café — 東京タワー 🚀🎉 done", "🤖 emoji 👩‍💻 with joiners and ∑ maths ≤ ≥"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_hf_decode_with_no_replacement_character(bpe_tokenizer, text):
    prompt = bpe_tokenizer.encode("Say:")
    ids = bpe_tokenizer.encode(text)
    # The test means something only if some character spans several tokens.
    assert any("\ufffd" in bpe_tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(bpe_tokenizer, prompt)
    pieces = [detok.add(i) for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + detok.flush() == bpe_tokenizer.decode(ids)
    assert any(p == "" for p in pieces)  # a partial character was held back


def test_a_stop_string_split_over_tokens_never_reaches_the_stream(bpe_tokenizer):
    ids = bpe_tokenizer.encode("answer: 42 🚀END and more")
    detok = IncrementalDetokenizer(bpe_tokenizer, [], stop=("🚀END",))
    streamed = ""
    for i in ids:
        streamed += detok.add(i)
        if detok.stopped:
            break
    streamed += detok.flush()
    assert detok.stopped and streamed == "answer: 42 "
