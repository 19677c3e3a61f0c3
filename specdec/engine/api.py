"""What every engine offers: the in-process `SpeculativeEngine` and the Ray `actors.RayEngine`.

Both take a `GenerationRequest` or its fields and stream `StreamChunk`s in commit order; exactly one
chunk, the last, carries the finish reason and the whole `GenerationOutput`. Dropping the stream
cancels the request and frees its caches. `generate` is the stream drained to its last chunk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from specdec.engine.prompt import Prompt
from specdec.engine.request import GenerationRequest
from specdec.engine.request_state import GenerationOutput, StreamChunk


class Engine(ABC):
    @abstractmethod
    def generate_stream(self, prompt: Prompt | GenerationRequest | None = None, **fields) -> Iterator[StreamChunk]:
        """Yield what each step commits (see the module docstring)."""

    def generate(self, prompt: Prompt | GenerationRequest | None = None, **fields) -> GenerationOutput:
        """Generate a completion: text, token ids, finish reason, usage and speculation stats.

        Pass a `GenerationRequest`, or its fields: `prompt` is text, or with `chat=True` a list of
        {"role", "content"} messages; or `prompt_token_ids`; `sampling`; `num_speculative_tokens`
        overrides the engine's K (an int, "auto", or 0 for target-only) for this request."""
        return last_chunk(self.generate_stream(prompt, **fields)).output

    @abstractmethod
    def generate_batch(self, requests: Sequence[GenerationRequest | Prompt]) -> list[GenerationOutput]:
        """Generate many completions together; outputs in the order of `requests`."""

    @abstractmethod
    def shutdown(self) -> None:
        """Fail what is still running and free the engine's threads or actors."""


def last_chunk(chunks: Iterator[StreamChunk]) -> StreamChunk:
    """A stream drained to its last chunk (the one with the whole output)."""
    last = None
    for last in chunks:
        pass
    if last is None or last.output is None:
        raise RuntimeError("the stream ended without a final chunk")
    return last
