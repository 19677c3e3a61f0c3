"""What a request's output must match (`Constraint`) and the vocabulary its mask is over.

A value of the request's parameters (`SamplingParams.structured`), so it lives at the bottom of the
core with `config.py`; the grammar engine that compiles and applies it is
`specdec.decoding.structured_output`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: The kinds of constraint a request may name (`Constraint.kind`).
KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Vocabulary:
    """Where a process finds the tokenizer its masks are over (a path: Ray workers load it themselves),
    the logits' width and the end-of-sequence ids the grammar lets through when it is complete."""

    source: str  # the model spec (a path or a preset) whose tokenizer the masks are over
    size: int  # the logits' width (may exceed the tokenizer's vocabulary)
    eos_token_ids: tuple[int, ...]
    trust_remote_code: bool = False


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `spec`: the JSON schema (JSON text), the regex, the Lark grammar,
    or the choices (a JSON list of strings); unused for `json_object` (any JSON object)."""

    kind: str
    spec: str = ""
    vocabulary: Vocabulary | None = None  # set by the engine at admission

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            object.__setattr__(self, "spec", json.dumps(self.spec))

    @property
    def label(self) -> str:
        """The feature label metrics use."""
        return "json_schema" if self.kind in ("json_object", "json_schema") else "grammar"
