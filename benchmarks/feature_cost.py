"""What request features cost speculation: acceptance and tokens/s with and without log-probabilities
and penalties, each against target-only decoding of the same request, in one run.

For each feature set (plain; logprobs=5; penalties: repetition 1.1 as Qwen's generation config,
presence 0.5, frequency 0.2; both) and each sampling setting (greedy; T=0.7, top_p 0.8, top_k 20
seeded, invariant), every prompt runs target-only (K=0) and speculative (auto-K), interleaved prompt
by prompt on one in-process engine. Speedup = median over prompts of (speculative tok/s / target-only
tok/s of the same prompt and settings).

    python -m benchmarks.feature_cost --out docs/bench/feature-cost

With `--structured`, the rows are structured output instead: chat prompts that ask for JSON
(`JSON_PROMPTS`), each without a constraint ("plain") and with its JSON schema ("json_schema",
`response_format` json_schema), generated to the end of the JSON (no `ignore_eos`: past the end the
grammar allows only EOS), so tok/s counts the tokens each produced.

    python -m benchmarks.feature_cost --structured --out docs/bench/structured-output
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from specdec.config import EngineConfig, SamplingParams
from specdec.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.options import add_arguments

FEATURES = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.2},
    "logprobs+penalties": {"logprobs": 5, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                           "frequency_penalty": 0.2},
}
SETTINGS = {"greedy": {}, "T0.7-p0.8-k20": {"temperature": 0.7, "top_p": 0.8, "top_k": 20}}

_PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "languages": {"type": "array", "items": {"type": "string"}},
    "email": {"type": "string"}}, "required": ["name", "age", "languages", "email"], "additionalProperties": False}
_FUNCTION = {"type": "object", "properties": {
    "name": {"type": "string"}, "parameters": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "type": {"type": "string"}}, "required": ["name", "type"],
        "additionalProperties": False}},
    "returns": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["name", "parameters", "returns", "summary"], "additionalProperties": False}
_BOOK = {"type": "object", "properties": {
    "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
    "genres": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "author", "year", "genres"],
    "additionalProperties": False}
#: (chat prompt, its schema): what a client sends with `response_format` json_schema.
JSON_PROMPTS = [
    ("Describe a fictional Python developer as JSON with name, age, languages and email.", _PERSON),
    ("Describe the Python function `def merge(a: list[int], b: list[int]) -> list[int]` as JSON: its name, "
     "parameters (name and type), return type and a one-line summary.", _FUNCTION),
    ("Give a classic science-fiction novel as JSON with title, author, year and genres.", _BOOK),
    ("Describe a fictional Rust developer as JSON with name, age, languages and email.", _PERSON),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, EngineConfig, only=("target", "draft"),
                  defaults={"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT})
    parser.add_argument("--limit", type=int, default=4)
    add_arguments(parser, SamplingParams, only=("max_tokens",), defaults={"max_tokens": 48})
    parser.add_argument("--out", default=None)
    parser.add_argument("--structured", action="store_true", help="rows with and without a JSON schema instead")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.prompts import humaneval
    from specdec import SpeculativeEngine
    from specdec.kernels.cpu import cpu_info

    from specdec.decoding.structured_output import Constraint

    engine = SpeculativeEngine.from_pretrained(args.target, draft=args.draft, num_speculative_tokens="auto")
    if args.structured:
        prompts = [[{"role": "user", "content": text}] for text, _ in JSON_PROMPTS[:args.limit]]
        schemas = [Constraint("json_schema", json.dumps(schema)) for _, schema in JSON_PROMPTS[:args.limit]]
        features = {"plain": lambda i: {}, "json_schema": lambda i: {"structured": schemas[i]}}
    else:
        prompts = [p.text for p in humaneval(args.limit)]
        features = {name: (lambda i, extra=extra: extra) for name, extra in FEATURES.items()}
    rows = []
    for setting, sampling in SETTINGS.items():
        for feature, extra in features.items():
            ratios, runs = [], {"target-only": [], "speculative": []}
            for i, prompt in enumerate(prompts):
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=not args.structured, seed=i,
                                        **sampling, **extra(i))
                speeds = {}
                for method, k in (("target-only", 0), ("speculative", None)):
                    out = engine.generate(prompt, sampling=params, num_speculative_tokens=k, chat=args.structured)
                    speeds[method] = out.tokens_per_second
                    runs[method].append(out)
                ratios.append(speeds["speculative"] / speeds["target-only"])
            spec = runs["speculative"]
            proposed = sum(o.speculative.num_draft_tokens for o in spec)
            row = {"setting": setting, "features": feature,
                   "target_only_tok_s": round(statistics.median(o.tokens_per_second for o in runs["target-only"]), 3),
                   "speculative_tok_s": round(statistics.median(o.tokens_per_second for o in spec), 3),
                   "speedup": round(statistics.median(ratios), 3),
                   "acceptance": round(sum(o.speculative.num_accepted_tokens for o in spec) / proposed, 4)
                   if proposed else None,
                   "mean_k": round(statistics.mean(k for o in spec for k in o.k_history), 2),
                   "mean_tokens": round(statistics.mean(o.completion_tokens for o in spec), 1)}
            if args.structured:
                row["valid_json"] = f"{sum(_is_json(o.text) for o in spec)}/{len(spec)}"
                row["same_text_as_target_only"] = f"{sum(a.token_ids == b.token_ids for a, b in zip(spec, runs['target-only']))}/{len(spec)}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"target": args.target, "draft": args.draft,
              "prompts": f"JSON_PROMPTS[:{args.limit}] (chat)" if args.structured else f"HumanEval[:{args.limit}]",
              "max_tokens": args.max_tokens, "cpu": cpu_info().as_dict(), "threads": torch.get_num_threads(),
              "python": platform.python_version(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "structured-output" if args.structured else "feature-cost"
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        lines = ["| setting | features | target-only tok/s | speculative tok/s | speedup | acceptance | mean K |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['features']} | {r['target_only_tok_s']} | {r['speculative_tok_s']} | "
                  f"{r['speedup']}x | {r['acceptance']} | {r['mean_k']} |" for r in rows]
        (out / f"{name}.md").write_text(
            f"# What request features cost speculation\n\n{result['target']} + {result['draft']}, "
            f"{result['prompts']}, {args.max_tokens} tokens, CPU {result['cpu'].get('model')} "
            f"({', '.join(result['cpu'].get('flags', []))}), {result['threads']} threads, {result['date']}.\n\n"
            + "\n".join(lines) + "\n")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    main()
