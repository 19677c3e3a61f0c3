"""Time one batched decoding step at long context: where the time goes, and how many KV bytes move.

Run: `python -m benchmarks.step_profile --rows 1,4,8 --context 2000 --out step.json`; compare two runs
with `python -m benchmarks.step_profile --compare before.json after.json --out plot.png`.

For each row count it builds that many request caches of `--context` tokens (one real prefill of a
source-file prompt, copied: the timing does not depend on the tokens), then times, as the scheduler
runs them, a target verify forward of K+1 tokens per row and K single-token forwards per row (the
shape of the draft's proposal forwards, run here on the target; recorded as phase "draft").
Each is split into the model's forward (`model(...)`) and everything else (packing the batch,
gathering and writing back caches), and the bytes of KV the step copies are counted. Medians over
`--repeats` runs, each on caches rewound to the same length. It runs against whichever `specdec` is
importable, so the same script measures the code before and after a change (same day, same box).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.config import EngineConfig
from specdec.models.presets import DEFAULT_TARGET
from specdec.options import add_arguments


def _bytes_per_token(cache) -> int:
    total = 0
    for layer in cache.layers:
        k = layer.keys
        if k is not None and k.numel():
            total += 2 * k[..., :1, :].numel() * k.element_size()
    return total


def _timed_model(model):
    """Wrap `model.forward` to add up the seconds spent inside it."""
    spent = [0.0]
    original = model.forward

    def forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    model.forward = forward
    return spent


def _copy_cache(runner, cache):
    return copy.deepcopy(cache)


def profile(spec: str, rows_list: list[int], context_ids: list[int], k: int, repeats: int,
            kernel: str) -> list[dict]:
    from specdec.kernels.linear import prepare_target, settle_linear_kernel
    from specdec.models.model_runner import ModelRunner
    from specdec.models.loading import load_model

    loaded = load_model(spec)
    chosen = prepare_target(loaded.model, kernel, speculating=True)
    chosen, _ = settle_linear_kernel(loaded, chosen)
    runner = ModelRunner(loaded)
    base = runner.new_cache()
    for start in range(0, len(context_ids), 512):
        runner.forward([base], [context_ids[start:start + 512]], [1])
    per_token = _bytes_per_token(base)
    spent = _timed_model(loaded.model)
    results = []
    for rows in rows_list:
        caches = [base] + [_copy_cache(runner, base) for _ in range(rows - 1)]
        length = len(base)
        for name, tokens_per_row, forwards in (("verify", k + 1, 1), ("draft", 1, k)):
            totals, inside = [], []
            for _ in range(repeats + 1):  # the first is a warm-up
                for c in caches:
                    c.rewind(length)
                spent[0] = 0.0
                start = time.perf_counter()
                for f in range(forwards):
                    runner.forward(caches, [[100 + f] * tokens_per_row] * rows, [tokens_per_row] * rows)
                totals.append(time.perf_counter() - start)
                inside.append(spent[0])
            totals, inside = totals[1:], inside[1:]
            total, model = statistics.median(totals), statistics.median(inside)
            new = rows * tokens_per_row * forwards
            results.append({
                "phase": name, "rows": rows, "context": length, "tokens_per_row": tokens_per_row,
                "forwards": forwards, "step_s": total, "model_forward_s": model, "other_s": max(0.0, total - model),
                "other_share": max(0.0, total - model) / total,
                "kv_bytes_copied": new * per_token,  # flat forwards write only the new tokens
                "kv_bytes_per_token": per_token, "kernel": chosen,
            })
            print(json.dumps(results[-1]), flush=True)
        for c in caches[1:]:
            c.rewind(0)
    return results


def compare(before: dict, after: dict, plot_path: Path | None = None) -> str:
    """Markdown table of two profiles (before/after), and a bar plot of step seconds if asked."""
    cpu = after["meta"]["cpu"]
    lines = [f"CPU: {cpu.get('model')} ({cpu.get('isa')}); target {after['meta']['target']}, K={after['meta']['k']}, "
             f"medians of {after['meta']['repeats']} runs; before: {before['meta']['label']} "
             f"({before['meta']['measured_at']}), after: {after['meta']['label']} ({after['meta']['measured_at']}).",
             "",
             "| phase | rows x context | step s before | step s after | after/before | outside the forward before "
             "| after | KV bytes copied before | after |",
             "|---|---|---|---|---|---|---|---|---|"]
    pairs = [(b, a) for b in before["results"] for a in after["results"]
             if (b["phase"], b["rows"]) == (a["phase"], a["rows"])]
    for b, a in pairs:
        phase = "verify (K+1 tokens/row)" if a["phase"] == "verify" else f"{a['forwards']} decode forwards (1 token/row)"
        lines.append(f"| {phase} | {a['rows']} x {a['context']} | {b['step_s']:.3f} | {a['step_s']:.3f} | "
                     f"{a['step_s'] / b['step_s']:.2f}x | {100 * b['other_share']:.1f}% | {100 * a['other_share']:.2f}% | "
                     f"{b['kv_bytes_copied'] / 1e6:.1f} MB | {a['kv_bytes_copied'] / 1e6:.1f} MB |")
    if plot_path is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [("verify" if a["phase"] == "verify" else f"{a['forwards']}x decode") + f"\n{a['rows']} rows"
                  for _, a in pairs]
        x = range(len(pairs))
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.bar([i - 0.2 for i in x], [b["step_s"] for b, _ in pairs], 0.4, label="before (padded gather)")
        ax.bar([i + 0.2 for i in x], [a["step_s"] for _, a in pairs], 0.4, label="after (flat batch)")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"one step at {pairs[0][1]['context']} tokens of context per row ({cpu.get('isa')})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path, dpi=110)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, EngineConfig, only=("target",), defaults={"target": DEFAULT_TARGET})
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--prompts", default="benchmarks/data/source-2k.jsonl")
    add_arguments(parser, EngineConfig, only=("num_speculative_tokens",))
    parser.add_argument("--repeats", type=int, default=5)
    add_arguments(parser, EngineConfig, only=("linear_kernel",))
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="instead: write a Markdown table (and --out PNG plot) of two profiles")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare(before, after, args.out))
        return
    torch.set_num_threads(2)
    from specdec.kernels.cpu import cpu_info
    from specdec.models.loading import load_tokenizer

    prompt = json.loads(Path(args.prompts).read_text().splitlines()[0])["prompt"]
    tokenizer = load_tokenizer(args.target)
    ids = tokenizer(prompt)["input_ids"][: args.context]
    rows = [int(r) for r in args.rows.split(",")]
    results = profile(args.target, rows, ids, args.num_speculative_tokens, args.repeats, args.linear_kernel)
    meta = {"label": args.label, "target": args.target, "cpu": cpu_info().as_dict(),
            "num_speculative_tokens": args.num_speculative_tokens,
            "repeats": args.repeats, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
