"""Which grammar engine to use: time xgrammar, llguidance and outlines-core on one vocabulary.

For each engine and each constraint (JSON object mode, a JSON schema, a regex) it
measures what structured output pays per request and per token on this CPU:

- ``setup_s``: building the engine's view of the tokenizer (once per model);
- ``compile_s``: compiling the constraint and making its first matcher (once per
  request, before any caching; llguidance compiles lazily, inside the matcher);
- ``mask_ms``: per generated token, computing the allowed-token mask and advancing
  the matcher by one token (median over a valid output, tokenized by the model);
- ``rollback_ms``: rolling back 5 tokens and re-advancing them (what a rejected
  speculative block costs the matcher).

The engines other than llguidance (the one specdec depends on) are not dependencies: install them
first (`pip install xgrammar outlines-core`); one that cannot load is reported as an error row.

    python -m benchmarks.grammar_engines --model ~/.cache/specdec/models/qwen2.5-coder-0.5b-instruct \
        --json docs/bench/grammar-engines.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "languages": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "languages", "address"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(
    {"name": "Ada Lovelace", "age": 36, "languages": ["English", "French", "Analytical Engine"],
     "address": {"city": "London", "zip": "12345"}}
)
OBJECT_TEXT = json.dumps({"id": 7, "items": [1, 2, 3], "note": "free-form keys and values, nested {\"a\": true}"})
REGEX = r"[A-Z][a-z]+ [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,4})?"
REGEX_TEXT = "Callme 555-1234 ext. 42"
CASES = {"json_object": OBJECT_TEXT, "json_schema": SCHEMA_TEXT, "regex": REGEX_TEXT}


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size):
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, case):
        if case == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if case == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA))
        return self.compiler.compile_regex(REGEX)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=16)

    def step(self, m, token):
        m.fill_next_token_bitmask(self.bitmask)
        assert self._allowed(token), token
        assert m.accept_token(token)

    def _allowed(self, token):
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def rollback(self, m, n):
        m.rollback(n)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, case):
        L = self.llg.LLMatcher
        if case == "json_object":
            grammar = L.grammar_from_json_schema({"type": "object"})
        elif case == "json_schema":
            grammar = L.grammar_from_json_schema(SCHEMA)
        else:
            grammar = L.grammar_from_regex(REGEX)
        return grammar

    def matcher(self, grammar):
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def step(self, m, token):
        self.llg.torch.fill_next_token_bitmask(m, self.bitmask, 0)
        assert (int(self.bitmask[0, token // 32]) >> (token % 32)) & 1, (token, m.get_error())
        assert m.consume_token(token), m.get_error()

    def rollback(self, m, n):
        m.rollback(n)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size):
        from outlines_core import Vocabulary

        vocab = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id in (tokenizer.eos_token_id,) or token in tokenizer.all_special_tokens:
                continue
            vocab.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(token_id)
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, vocab)
        self.vocab_size = vocab_size

    def compile(self, case):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        if case == "json_object":
            regex = build_regex_from_schema(json.dumps({"type": "object"}))
        elif case == "json_schema":
            regex = build_regex_from_schema(json.dumps(SCHEMA))
        else:
            regex = REGEX
        return Index(regex, self.vocabulary)

    def matcher(self, index):
        from outlines_core import Guide

        return Guide(index, max_rollback=16)

    def step(self, m, token):
        allowed = m.get_tokens()
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[torch.tensor(allowed)] = True
        assert mask[token], token
        m.advance(token)

    def rollback(self, m, n):
        m.rollback_state(n)


ENGINES = (Xgrammar, Llguidance, OutlinesCore)


def measure(engine, tokenizer, case, text):
    start = time.perf_counter()
    compiled = engine.compile(case)
    matcher = engine.matcher(compiled)
    compile_s = time.perf_counter() - start
    tokens = tokenizer.encode(text, add_special_tokens=False)
    per_token = []
    for token in tokens:
        start = time.perf_counter()
        engine.step(matcher, token)
        per_token.append((time.perf_counter() - start) * 1e3)
    rollbacks = []
    fresh = engine.matcher(compiled)
    for i, token in enumerate(tokens):
        engine.step(fresh, token)
        if i >= 5 and i % 3 == 0:
            start = time.perf_counter()
            engine.rollback(fresh, 5)
            for t in tokens[i - 4 : i + 1]:
                engine.step(fresh, t)
            rollbacks.append((time.perf_counter() - start) * 1e3)
    return {
        "compile_s": round(compile_s, 4),
        "tokens": len(tokens),
        "mask_ms_median": round(statistics.median(per_token), 4),
        "mask_ms_max": round(max(per_token), 3),
        "rollback5_and_replay_ms_median": round(statistics.median(rollbacks), 4) if rollbacks else None,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local model directory (its tokenizer is used)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.model).expanduser())
    vocab_size = AutoConfig.from_pretrained(Path(args.model).expanduser()).vocab_size
    rows = []
    for engine_cls in ENGINES:
        start = time.perf_counter()
        try:
            engine = engine_cls(tokenizer, vocab_size)
        except Exception as error:  # an engine that cannot load is reported, not fatal
            rows.append({"engine": engine_cls.name, "error": repr(error)})
            continue
        setup_s = time.perf_counter() - start
        for case, text in CASES.items():
            try:
                row = measure(engine, tokenizer, case, text)
            except Exception as error:
                row = {"error": repr(error)[:300]}
            rows.append({"engine": engine_cls.name, "case": case, "setup_s": round(setup_s, 3), **row})
            print(json.dumps(rows[-1]), flush=True)
    import importlib.metadata as md

    versions = {}
    for dist in ("xgrammar", "llguidance", "outlines-core"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    result = {"cpu": _cpu(), "model": str(args.model), "vocab_size": vocab_size, "versions": versions, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _cpu():
    from specdec.kernels.cpu import cpu_info

    return cpu_info().as_dict()


if __name__ == "__main__":
    main()
