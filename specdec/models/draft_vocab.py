"""A frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856).

A large vocabulary makes the draft's `lm_head` a big share of its per-token work (Qwen2.5's 151,936
rows are ~27% of the 0.5B draft's). The draft can propose from the N most frequent tokens only:
its head computes N logits, and every other token gets -inf, so the draft's distribution q is the
softmax over those N tokens (renormalized there, zero elsewhere). That q is exactly what the
proposal was sampled from, so rejection sampling stays exact; the target still verifies over the
full vocabulary, and a token outside the N is still produced whenever the target wants it (as a
recovered or bonus token). Greedy output is unchanged; only acceptance can drop, by at most the
share of target tokens outside the N.

Frequencies: the tokenizer's counts over a local corpus, Python's own standard library (code and
English docstrings, ~3M tokens, present wherever Python is; FR-Spec counts SlimPajama), then the
unseen tokens in id order (byte-level BPE ids follow merge order, a proxy for frequency); the
tokenizer's special tokens (EOS, chat markers) always belong to the set. The ranking is computed
once per tokenizer and kept in the specdec cache (`$SPECDEC_CACHE/vocab/`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import tempfile
from collections import Counter
from pathlib import Path

import torch

from specdec.models import model_cache

logger = logging.getLogger(__name__)

#: Largest corpus read for the counts (bytes): the standard library is ~13 MB of .py files.
_CORPUS_BYTES = 16 << 20


class ReducedVocabHead(torch.nn.Module):
    """An output head over `token_ids` only, returning full-vocabulary logits with -inf elsewhere.

    The rest of the stack (greedy argmax, sampling warpers, q for verification) sees an ordinary
    `[..., vocab]` tensor whose mass lies on the N kept tokens.
    """

    def __init__(self, head: torch.nn.Linear, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = self.out_features = vocab_size  # the logits it returns, as for an nn.Linear head
        self.register_buffer("token_ids", token_ids.to(torch.long), persistent=False)  # [N]
        weight = head.weight.detach()[self.token_ids].clone()  # [N, hidden]
        bias = head.bias.detach()[self.token_ids].clone() if head.bias is not None else None
        self.linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                      device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias is not None:
                self.linear.bias.copy_(bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.linear(hidden)  # [..., N]
        logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))  # [..., vocab]
        logits[..., self.token_ids] = kept
        return logits

    def extra_repr(self) -> str:
        return f"kept={self.token_ids.numel()}, vocab_size={self.vocab_size}"


def restrict_vocab(model: torch.nn.Module, token_ids: torch.Tensor) -> None:
    """Give `model` (a copy the caller owns) an output head over `token_ids` only."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"cannot restrict the draft vocabulary of a {type(head).__name__} output head")
    reduced = ReducedVocabHead(head, token_ids, head.out_features)
    model.set_output_embeddings(reduced)
    # A tied head must not be re-tied to the embeddings (transformers does so on some calls).
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def _corpus_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if not ({"site-packages", "test", "tests"} & set(p.parts)))
    return files


def _tokenizer_key(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
    return f"{digest}-{len(vocab)}"


def frequency_ranking(tokenizer, vocab_size: int) -> list[int]:
    """Every token id below `vocab_size`, most frequent first (see the module docstring); cached."""
    path = model_cache.cache_root() / "vocab" / f"{_tokenizer_key(tokenizer)}.json"
    try:
        ranking = json.loads(path.read_text())
        if isinstance(ranking, list) and len(ranking) == vocab_size:
            return ranking
    except (OSError, ValueError):
        pass
    counts: Counter[int] = Counter()
    texts, size = [], 0
    for file in _corpus_files():
        try:
            text = file.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        texts.append(text)
        size += len(text)
        if size >= _CORPUS_BYTES:
            break
    logger.info("counting token frequencies over %d standard-library files (%.1f MB)", len(texts), size / 1e6)
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        counts.update(ids)
    seen = [i for i, _ in counts.most_common() if i < vocab_size]
    seen_set = set(seen)
    ranking = seen + [i for i in range(vocab_size) if i not in seen_set]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(ranking, f)
    os.replace(tmp, path)
    return ranking


def draft_token_ids(tokenizer, vocab_size: int, num_tokens: int) -> torch.Tensor:
    """The `num_tokens` most frequent ids plus every special token, sorted: `[<= num_tokens + specials]`."""
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise ValueError(f"draft vocabulary size must be an integer >= 1, got {num_tokens!r}")
    ranking = frequency_ranking(tokenizer, vocab_size)
    kept = set(ranking[:num_tokens])
    kept.update(i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size)
    kept.update(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if 0 <= i < vocab_size)
    return torch.tensor(sorted(kept), dtype=torch.long)
