"""How far each target precision is from float32: weight error, perplexity on held-out text, and how
many greedy outputs differ.

    python -m benchmarks.precision_quality [--target qwen2.5-coder-1.5b-instruct] [--max-tokens 96]
        [--precisions float32,int4,int8-weight] [--out docs/bench/target-precision-quality.json]

- weights: for every int4 module built from the file's codes, its kernel weight ((q - 8) * s + z
  with bfloat16 s and z) against the file's own dequantization (the float32 model transformers
  loaded); for every int8 module, its dequantized weight against the same. Max absolute and relative
  RMS errors, per form.
- perplexity: the target alone, teacher-forced over the held-out prompts
  (`benchmarks/data/heldout.jsonl`, written for this project: SQL, shell, Rust, OpenAPI, HTML and
  prose), one forward per prompt, every position scored.
- greedy: `--max-tokens` new tokens of each held-out prompt at each precision (target alone); the
  prompts whose tokens differ from float32's, and where they first differ.

Each precision loads on its own (one at a time: the float32 target alone is 6 GB prepacked).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def weight_errors(target: str) -> dict:
    """Per form (int4 from the file's codes, int8 for the rest): max |error| and relative RMS error
    of the weights the kernels multiply by, against the file's dequantized float32 weights."""
    from specdec.kernels.linear import Int8WeightLinear
    from specdec.kernels.quantized import GROUP_SIZE
    from specdec.kernels.target_precision import codes_source, iter_codes
    from specdec.models.loading import load_model

    loaded = load_model(target)
    model, source = loaded.model, codes_source(loaded.source)
    stats: dict[str, list[float]] = {"int4 (the file's Q4 codes)": [0.0, 0.0, 0.0],
                                     "int8 weight-only (the file's Q6_K/Q8_0 weights)": [0.0, 0.0, 0.0]}
    coded = set()
    with torch.no_grad():
        for name, c in iter_codes(source, model):
            coded.add(name)
            file_weight = model.get_parameter(name).float()
            s = c.scale.to(torch.bfloat16).float()
            z = (8 * c.scale - c.minimum).to(torch.bfloat16).float()
            n, k = c.shape
            kernel = ((c.q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8) * s[..., None] + z[..., None])
            _accumulate(stats["int4 (the file's Q4 codes)"], kernel.reshape(n, k) - file_weight, file_weight)
        for module_name, module in model.named_modules():
            if type(module) is torch.nn.Linear and f"{module_name}.weight" not in coded:
                int8 = Int8WeightLinear(module)
                weight = int8.weight_int8.float() * int8.scales.float()[:, None]
                _accumulate(stats["int8 weight-only (the file's Q6_K/Q8_0 weights)"], weight - module.weight,
                            module.weight)
    return {form: {"max_abs_error": m, "relative_rms_error": math.sqrt(e / w) if w else None}
            for form, (m, e, w) in stats.items() if w}


def _accumulate(acc: list[float], error: torch.Tensor, weight: torch.Tensor) -> None:
    acc[0] = max(acc[0], float(error.abs().max()))
    acc[1] += float((error.double() ** 2).sum())
    acc[2] += float((weight.double() ** 2).sum())


def measure(target: str, precision: str, prompts: list[str], max_tokens: int) -> dict:
    from specdec import EngineConfig, SamplingParams, SpeculativeEngine

    engine = SpeculativeEngine.from_config(EngineConfig(target=target, draft="none", target_precision=precision))
    runner = engine.target
    nll, count = 0.0, 0
    outputs = []
    started = time.perf_counter()
    for text in prompts:
        ids = engine.tokenize(text)
        logits = runner.forward([runner.new_cache()], [ids], [len(ids)])[0]  # [T, vocab]
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        nll -= float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
        outputs.append(engine.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=max_tokens)).token_ids)
    engine.shutdown()
    return {"precision": engine.target_precision, "perplexity": math.exp(nll / count), "tokens_scored": count,
            "greedy": outputs, "seconds": round(time.perf_counter() - started, 1),
            "weights": engine.calibration["target_precision"].get("weights")}


def main(argv: list[str] | None = None) -> int:
    from specdec.kernels.cpu import cpu_info
    from specdec.models.presets import DEFAULT_TARGET

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--precisions", default="float32,int4,int8-weight")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "data" / "heldout.jsonl")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    results = {"target": args.target, "cpu": cpu_info().as_dict(), "prompts": str(args.prompts),
               "max_tokens": args.max_tokens, "weights": weight_errors(args.target), "precisions": []}
    for precision in args.precisions.split(","):
        print(f"[precision_quality] {precision} ...", file=sys.stderr, flush=True)
        results["precisions"].append(measure(args.target, precision, prompts, args.max_tokens))
    reference = results["precisions"][0]["greedy"]
    for r in results["precisions"]:
        r["greedy_differs"] = sum(a != b for a, b in zip(r["greedy"], reference))
        r["first_difference"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                 for a, b in zip(r["greedy"], reference)]
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def markdown(results: dict) -> str:
    base = results["precisions"][0]
    lines = [f"Target {results['target']}, CPU {results['cpu'].get('model')} ({results['cpu'].get('isa')}); "
             f"{len(base['greedy'])} held-out prompts ({base['tokens_scored']} tokens scored), "
             f"{results['max_tokens']} greedy tokens each, target alone.", "",
             "| precision | perplexity | vs " + base["precision"] + " | greedy outputs that differ from "
             + base["precision"] + " | first difference at token |", "|---|---|---|---|---|"]
    for r in results["precisions"]:
        lines.append(f"| {r['precision']} | {r['perplexity']:.4f} | {r['perplexity'] / base['perplexity']:.4f}× | "
                     f"{r['greedy_differs']}/{len(r['greedy'])} | "
                     f"{', '.join(str(i) for i in r['first_difference'] if i is not None) or '–'} |")
    lines += ["", "| weights | max abs error vs the file's dequantized weights | relative RMS error |", "|---|---|---|"]
    for form, e in results["weights"].items():
        lines.append(f"| {form} | {e['max_abs_error']:.3g} | {e['relative_rms_error']:.3g} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
