"""Structured output: a grammar (JSON schema, JSON object, regex, Lark, a choice) masks the logits.

The engine is llguidance (`docs/bench/grammar-engines.json`, Sapphire Rapids, Qwen vocabulary): a
mask plus one token costs 0.03-0.05 ms (xgrammar 0.006-0.02 ms, outlines-core 0.05-28 ms), both
far below a ~30-100 ms decoding step on this CPU; xgrammar needs triton and tvm-ffi (1 GB on disk,
never used on a CPU), llguidance is 8 MB without dependencies. Its tokenizer view takes ~4 s to
build once per process; compiling a schema takes ~1-3 ms.

**Lossless under speculation.** The mask is a function of the tokens before a position, like the
penalties (`logits_processing.process` applies it last): the target's row j is masked from the
committed output plus the proposed tokens before j, the draft's q from the committed output plus
its own proposals so far. A matcher is stateful, so `Grammar.allowed` keeps a small pool of matchers
per grammar and brings one to the asked-for tokens: the one sharing the longest prefix with them is
rolled back to that prefix and advanced through the rest (a rejected block costs a rollback, not a
replay). So every caller (verification, the in-process draft, a Ray draft worker, target-only
decoding) computes the same mask for the same tokens, and the output equals target-only constrained
decoding: greedy token for token, invariant sampling token for token for a seed.

After the grammar is complete only end-of-sequence tokens are allowed; tokens after one (a draft's
proposals past the end, which are never emitted) are not constrained.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from specdec.constraint import Constraint, Vocabulary  # noqa: F401 - Constraint: its home before 0.1.0

if TYPE_CHECKING:  # torch loads with the first mask: `specdec --help` imports this module through config
    import torch


#: JSON is written as `json.dumps` writes it (", " and ": ", no other whitespace): free whitespace
#: lets a model loop on spaces and newlines until max_tokens, which small models do.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Matchers kept per grammar: enough for every live request and its draft (LRU beyond).
POOL_SIZE = 32


class ConstraintError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the problem."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint. Raises ConstraintError naming what is wrong."""
    import llguidance

    L = llguidance.LLMatcher
    try:
        if constraint.kind == "json_object":
            return L.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if constraint.kind == "json_schema":
            try:
                schema = json.loads(constraint.spec)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("the JSON schema must be a JSON object")
            return L.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if constraint.kind == "regex":
            return L.grammar_from_regex(constraint.spec)
        return L.grammar_from_lark(_lark(constraint))
    except ConstraintError:
        raise
    except Exception as e:  # llguidance raises ValueError/RuntimeError with its own message
        raise ConstraintError(f"cannot compile the {constraint.kind}: {e}") from None


def _lark(constraint: Constraint) -> str:
    """The Lark source of a `grammar` or `choice` constraint."""
    if constraint.kind == "grammar":
        return constraint.spec
    try:
        choices = json.loads(constraint.spec)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ConstraintError("choice must be a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def validate(constraint: Constraint) -> None:
    """Compile `constraint` without a vocabulary (what an API layer can check before dispatching).
    Raises ConstraintError naming the problem."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint))
    if error and not error.startswith("WARNING"):
        raise ConstraintError(f"cannot compile the {constraint.kind}: {_one_line(error)}")


def check(constraint: Constraint) -> None:
    """Compile `constraint` against its vocabulary now: a request with a bad schema fails at
    admission (HTTP 400), not mid-generation. Raises ConstraintError."""
    import llguidance

    grammar = grammar_text(constraint)
    error = llguidance.LLMatcher.validate_grammar(grammar, prepare(constraint.vocabulary).tokenizer)
    if error and not error.startswith("WARNING"):
        raise ConstraintError(f"cannot compile the {constraint.kind}: {_one_line(error)}")
    _grammar(constraint)  # compiled once here, off the decoding loop's critical path


def allowed(constraint: Constraint, output: Sequence[int]) -> torch.Tensor:
    """`[vocab]` bool: the tokens the constraint allows after `output` (the tokens emitted so far, or
    proposed ahead of the position)."""
    return _grammar(constraint).allowed(output)


def apply(scores: torch.Tensor, constraint: Constraint, output: Sequence[int]) -> torch.Tensor:
    """`[1, vocab]` scores with every token the constraint forbids after `output` set to -inf."""
    import torch

    mask = allowed(constraint, output)
    width = scores.shape[-1]
    if mask.numel() < width:  # a draft whose logits are wider than the target's vocabulary
        mask = torch.cat([mask, mask.new_zeros(width - mask.numel())])
    return scores.masked_fill(~mask[:width].to(scores.device), float("-inf"))


@dataclass(frozen=True)
class _View:
    """llguidance's tokenizer, and the added tokens it treats as special ((id, text) pairs)."""

    tokenizer: object
    special: tuple[tuple[int, str], ...]


_tokenizers: dict[Vocabulary, _View] = {}
_tokenizers_lock = threading.Lock()


def prepare(vocabulary: Vocabulary, hf_tokenizer=None) -> _View:
    """llguidance's view of a vocabulary's tokenizer, built once per process (~4 s for a 152k
    vocabulary): from `hf_tokenizer` when the caller has it loaded, else loaded from the source.

    llguidance treats every added token as special, also those a tokenizer marks `special: false`
    (Qwen2.5's `<tool_call>`, `</tool_call>`, its FIM tokens): its mask allows such a token where the
    grammar expects its text, and then refuses to consume it. `Grammar.allowed` drops those from the
    mask, and a Lark literal equal to one's text also accepts the token itself (`_accept_added`)."""
    import llguidance.hf

    if vocabulary is None:
        raise ConstraintError("structured output needs the engine's vocabulary (set at admission)")
    with _tokenizers_lock:
        if vocabulary not in _tokenizers:
            if hf_tokenizer is None:
                from specdec.models.loading import load_tokenizer

                hf_tokenizer = load_tokenizer(vocabulary.source, vocabulary.trust_remote_code)
            try:
                tokenizer = llguidance.hf.from_tokenizer(
                    hf_tokenizer, n_vocab=vocabulary.size, eos_token=list(vocabulary.eos_token_ids))
            except ValueError as e:
                raise ConstraintError(f"structured output is not available for {vocabulary.source!r}: the grammar "
                                      f"engine cannot read its tokenizer ({_one_line(str(e))})") from None
            added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
            special = tuple((int(i), str(t)) for i, t in sorted(added.items())
                            if int(i) < vocabulary.size and tokenizer.is_special_token(int(i)))
            _tokenizers[vocabulary] = _View(tokenizer, special)
        return _tokenizers[vocabulary]


@lru_cache(maxsize=64)
def _grammar(constraint: Constraint) -> "Grammar":
    return Grammar(constraint)


class _Matcher:
    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.tokens: list[int] = []  # consumed, in order


class Grammar:
    """One compiled constraint and a pool of matchers at various points of outputs (thread-safe)."""

    def __init__(self, constraint: Constraint) -> None:
        import llguidance

        self.constraint = constraint
        view = prepare(constraint.vocabulary)
        self.tokenizer = view.tokenizer
        self.text = grammar_text(constraint)
        if constraint.kind in ("grammar", "choice") and view.special:
            self.text = llguidance.LLMatcher.grammar_from_lark(_accept_added(_lark(constraint), view.special))
        eos = set(constraint.vocabulary.eos_token_ids)
        self._special = [i for i, _ in view.special if i not in eos]  # checked against each mask
        self._llg = llguidance
        self.eos = [i for i in constraint.vocabulary.eos_token_ids if i < constraint.vocabulary.size]
        self.size = constraint.vocabulary.size
        self._pool: OrderedDict[int, _Matcher] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()
        first = self._new()
        if first.matcher.is_error():
            raise ConstraintError(f"cannot compile the {constraint.kind}: {first.matcher.get_error()}")
        self._add(first)

    def _new(self) -> _Matcher:
        return _Matcher(self._llg.LLMatcher(self.tokenizer, self.text, log_level=0))

    def _add(self, m: _Matcher) -> None:
        self._pool[self._next] = m
        self._next += 1
        while len(self._pool) > POOL_SIZE:
            self._pool.popitem(last=False)

    def allowed(self, output: Sequence[int]) -> torch.Tensor:
        import torch

        output = list(output)
        with self._lock:
            key, m = self._closest(output)
            self._pool.move_to_end(key)
            self._sync(m, output)
            if m.matcher.is_stopped():
                mask = torch.zeros(self.size, dtype=torch.bool, device="cpu")  # on the host, as llguidance's
                mask[self.eos] = True
                return mask
            mask = _unpack(torch.frombuffer(bytearray(m.matcher.compute_bitmask()), dtype=torch.int32), self.size)
            refused = [token for token in self._special  # allowed by the mask, refused when consumed (`prepare`)
                       if mask[token] and m.matcher.validate_tokens([token]) != 1]
            mask[refused] = False
            if refused and not bool(mask.any()):
                names = ", ".join(repr(self.tokenizer.dbg_tokens([t])) for t in refused)
                raise ConstraintError(
                    f"the {self.constraint.kind} allows no token after {len(output)} output tokens: it needs the "
                    f"text of an added token ({names}), which the grammar engine cannot spell in bytes; in a Lark "
                    "grammar (structured_outputs.grammar) a literal of that text matches the token itself")
        return mask

    def _closest(self, output: list[int]) -> tuple[int, _Matcher]:
        best, best_key, best_len = None, None, -1
        for key, m in self._pool.items():
            n = _common(m.tokens, output)
            if n > best_len:
                best, best_key, best_len = m, key, n
        if best_len < len(best.tokens) and best_len < len(output):
            # Diverged: keep this matcher for the other output (another request or draft branch).
            fork = _Matcher(best.matcher.deep_copy())
            fork.tokens = list(best.tokens)
            self._add(fork)
            return self._next - 1, fork
        return best_key, best

    def _sync(self, m: _Matcher, output: list[int]) -> None:
        keep = _common(m.tokens, output)
        if keep < len(m.tokens):
            # A matcher that ended (consumed EOS) does not come back by rolling back: replay.
            if (keep == 0 or m.matcher.is_stopped()
                    or not m.matcher.rollback(len(m.tokens) - keep) or m.matcher.is_error()):
                m.matcher = self._new().matcher
                keep = 0
            del m.tokens[keep:]
        for token in output[keep:]:
            if m.matcher.is_stopped():
                break  # tokens after the end are not constrained (they are never emitted)
            if not m.matcher.consume_token(int(token)):
                error = m.matcher.get_error().splitlines()[0] if m.matcher.get_error() else "rejected"
                m.matcher = self._new().matcher  # an erred matcher stays erred (reset too)
                m.tokens.clear()
                raise RuntimeError(f"token {token} is not allowed by the {self.constraint.kind} "
                                   f"after {len(output)} tokens: {error}")
            m.tokens.append(int(token))


def _accept_added(lark: str, added: tuple[tuple[int, str], ...]) -> str:
    """A Lark grammar where each string literal equal to an added token's text also accepts that
    token by id (`<[id]>`): the model's own `<tool_call>` token, not only its spelling in bytes."""
    for token, text in added:
        literal = json.dumps(text)
        lark = lark.replace(literal, f"({literal} | <[{token}]>)")
    return lark


def _one_line(error: str) -> str:
    return " ".join(line.strip() for line in error.strip().splitlines() if line.strip())[:400]


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _unpack(bits: torch.Tensor, size: int) -> torch.Tensor:
    """llguidance's bitmask (int32 words, bit i of word w = token 32w+i) -> `[size]` bool."""
    import torch

    mask = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bits.device)) & 1).bool().flatten()
    if mask.numel() < size:
        mask = torch.cat([mask, mask.new_zeros(size - mask.numel())])
    return mask[:size]
