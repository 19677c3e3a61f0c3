"""What request features cost speculation: acceptance and tokens/s with and without log-probabilities
and penalties, each against target-only decoding of the same request, in one run.

For each feature set (plain; logprobs=5; penalties: repetition 1.1 as Qwen's generation config,
presence 0.5, frequency 0.2; both) and each sampling setting (greedy; T=0.7, top_p 0.8, top_k 20
seeded, invariant), every prompt runs target-only (K=0) and speculative (auto-K), interleaved prompt
by prompt on one in-process engine. Speedup = median over prompts of (speculative tok/s / target-only
tok/s of the same prompt and settings).

    python -m benchmarks.feature_cost --out docs/bench/feature-cost
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

FEATURES = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.2},
    "logprobs+penalties": {"logprobs": 5, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                           "frequency_penalty": 0.2},
}
SETTINGS = {"greedy": {}, "T0.7-p0.8-k20": {"temperature": 0.7, "top_p": 0.8, "top_k": 20}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from benchmarks.prompts import humaneval
    from specdec import SamplingParams, SpeculativeEngine
    from specdec.cpu import cpu_info

    engine = SpeculativeEngine.from_pretrained(args.target, draft=args.draft, num_speculative_tokens="auto")
    prompts = [p.text for p in humaneval(args.limit)]
    rows = []
    for setting, sampling in SETTINGS.items():
        for feature, extra in FEATURES.items():
            ratios, runs = [], {"target-only": [], "speculative": []}
            for i, prompt in enumerate(prompts):
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i, **sampling, **extra)
                speeds = {}
                for method, k in (("target-only", 0), ("speculative", None)):
                    out = engine.generate(prompt, sampling=params, num_speculative_tokens=k)
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
                   "mean_k": round(statistics.mean(k for o in spec for k in o.k_history), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"target": args.target, "draft": args.draft, "prompts": f"HumanEval[:{args.limit}]",
              "max_tokens": args.max_tokens, "cpu": cpu_info().as_dict(), "threads": torch.get_num_threads(),
              "python": platform.python_version(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "feature-cost.json").write_text(json.dumps(result, indent=1) + "\n")
        lines = ["| setting | features | target-only tok/s | speculative tok/s | speedup | acceptance | mean K |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['features']} | {r['target_only_tok_s']} | {r['speculative_tok_s']} | "
                  f"{r['speedup']}x | {r['acceptance']} | {r['mean_k']} |" for r in rows]
        (out / "feature-cost.md").write_text(
            f"# What request features cost speculation\n\n{result['target']} + {result['draft']}, "
            f"{result['prompts']}, {args.max_tokens} tokens, CPU {result['cpu'].get('model')} "
            f"({', '.join(result['cpu'].get('flags', []))}), {result['threads']} threads, {result['date']}.\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
