"""How often a seeded sampled request's text changes with load, per sampling mode and draft precision.

For the tiny random Llama + perturbed draft (as `greedy_divergence`), N prompts x T tokens, each
prompt with its own seed, temperature 1:
- `invariant`: the text with speculation (alone; 8 at once under a token budget of 16; pipelined)
  vs target-only decoding of the same seed;
- `residual`: the text 8 at once under a token budget of 16, and pipelined, vs the same engine
  setting alone (auto-K; a seeded residual request's K follows its own history).
A prompt counts as diverged when any of its tokens differs. Float32 drafts should give 0; a
bfloat16 or int8-weight draft's q moves with the shape of the forward it ran in (bfloat16 rounding),
which flips a residual draw now and then (invariant text does not depend on the draft at all).

    python -m benchmarks.seeded_stability --out docs/bench/seeded-stability-tiny.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.greedy_divergence import _summary, report, tiny_pair


def _run(engine, prompts, params, concurrent: int = 1) -> list[list[int]]:
    def one(i):
        return engine.generate(prompt_token_ids=prompts[i], sampling=params.replace(seed=i)).token_ids

    with ThreadPoolExecutor(concurrent) as pool:
        return list(pool.map(one, range(len(prompts))))


def measure(target: Path, draft: Path, precision: str, prompts, tokens: int) -> list[dict]:
    from specdec import SamplingParams, SpeculativeEngine

    def engine(**kwargs):
        return SpeculativeEngine.from_pretrained(str(target), draft=str(draft), draft_precision=precision,
                                                 num_speculative_tokens="auto", **kwargs)

    def pipelined(e):
        pool = e.scheduler.draft
        pool.capabilities = dataclasses.replace(pool.capabilities, concurrent=True, pipeline=True)
        return e

    rows = []
    for mode in ("invariant", "residual"):
        params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, speculative_sampling=mode)
        reference = (_run(SpeculativeEngine.from_pretrained(str(target), draft="none"), prompts, params)
                     if mode == "invariant" else _run(engine(), prompts, params))
        name = "target_only" if mode == "invariant" else "alone"
        if mode == "invariant":
            rows.append(_summary(f"{mode}_alone_vs_{name}", _run(engine(), prompts, params), reference))
        rows.append(_summary(f"{mode}_8_at_once_budget16_vs_{name}",
                             _run(engine(max_batch_tokens=16, max_batch_size=8), prompts, params, 8), reference))
        rows.append(_summary(f"{mode}_pipelined_8_at_once_vs_{name}",
                             _run(pipelined(engine(max_batch_size=8)), prompts, params, 8), reference))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--precisions", default="none,bfloat16,int8-weight")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from specdec.kernels.cpu import cpu_info

    target, draft, prompts = tiny_pair(args.prompts)
    result = {"target": "tiny random Llama (vocab 512) + perturbed draft", "temperature": 1.0, "k": "auto",
              "prompts": len(prompts), "tokens": args.tokens, "cpu": cpu_info().as_dict(),
              "python": platform.python_version(), "torch": torch.__version__, "runs": {}}
    for precision in args.precisions.split(","):
        started = time.perf_counter()
        result["runs"][precision] = measure(target, draft, precision, prompts, args.tokens)
        report(f"draft precision {precision} ({time.perf_counter() - started:.0f}s)", result["runs"][precision])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
