"""Incremental detokenization with stop strings.

Text is produced token by token so it can stream, without re-decoding the whole output each time:
like vLLM's `detokenize_incrementally`, a short window of earlier tokens is decoded with the new
ones (tokenizers that merge spaces or bytes across tokens need it), and text that ends in an
unfinished UTF-8 sequence is held back. Text that could be the start of a stop string is held back
too, so a stop string never reaches the client; the stop string itself is not part of the text.
"""

from __future__ import annotations

from collections.abc import Sequence

_WINDOW = 6  # earlier tokens decoded together with new ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all decoded output text (before stop-string truncation)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def token_text(self, token_id: int) -> str:
        """One token's text decoded alone, special tokens included (log-probability listings, as vLLM)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text now safe to emit (may be empty).

        After a stop string completes, `stopped` is True and the text ends before the stop string.
        """
        if self.stopped:
            raise RuntimeError("add() after a stop string")
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = max(0, len(self.token_ids) - _WINDOW)
            # Keep the window in token positions relative to the trimmed list.
            self._trim()
            self.read_offset = len(self.token_ids)
        if self.stop:
            self._check_stop()
        return self._take()

    def _trim(self) -> None:
        if self.prefix_offset > 4 * _WINDOW:
            del self.token_ids[: self.prefix_offset]
            self.prefix_offset = 0

    def _check_stop(self) -> None:
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Characters at the end of the text that may be the start of a stop string."""
        if self.stopped or not self.stop:
            return 0
        tail = self.text[self.emitted :]
        for n in range(min(len(tail), max(len(s) for s in self.stop) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    def _take(self) -> str:
        end = len(self.text) - self._held_back()
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def flush(self) -> str:
        """At the end of generation: emit whatever was held back for a possible stop string."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
