"""What a speculative step sends over Ray: calls and pickled bytes per actor method, per request.

    python -m benchmarks.wire_per_step [--vocab 151936] [--prompt-tokens 200] [--out wire.json]

A tiny random llama pair (tests/tiny_models.py) at a real model's vocabulary size (Qwen2.5's by
default), a Ray engine with tp 1 and tp 2 target shards and a separate draft worker, one greedy and
one sampled (invariant) request of 32 tokens; each actor counts its calls and bytes
(`actors/wire.py`). Bytes depend on the vocabulary and the prompt, not on the model's width, so the
tiny pair shows what the real one sends. Results: docs/bench/ray-lean-step/.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import ray

from actors import RayEngineConfig, RolePlacement, build_ray_engine
from specdec import EngineConfig, SamplingParams


def measure(target, draft, tp: int, prompt: list[int], sampling: SamplingParams) -> tuple[dict, object]:
    """One request through a Ray engine (tp shards, a separate unpipelined draft worker): per
    "actor.method" its calls and bytes, the verify steps, and the request's output."""
    small = RolePlacement(num_cpus=0.1, num_threads=1)
    config = EngineConfig(target=str(target), draft=str(draft), num_speculative_tokens=4, draft_precision="none")
    engine = build_ray_engine(RayEngineConfig(engine=config, tp=tp, draft_placement="separate", pipeline=False,
                                              draft_role=small, target_role=small))
    try:
        handles = ray.get(engine.coordinator.handles.remote())
        actors = {**{f"shard{i}": s for i, s in enumerate(handles["shards"])}, "draft": handles["draft"]}
        ray.get([a.wire_log.remote(True) for a in actors.values()])
        output = engine.generate(prompt_token_ids=prompt, sampling=sampling)
        logs = dict(zip(actors, ray.get([a.wire_log.remote(False) for a in actors.values()])))
    finally:
        engine.shutdown()
    row = {"steps": len(output.k_history), "tokens": len(output.token_ids), "calls": {}, "bytes_sent": {},
           "bytes_returned": {}}
    for who, log in logs.items():
        for method, n in log["calls"].items():
            row["calls"][f"{who}.{method}"] = n
            row["bytes_sent"][f"{who}.{method}"] = log["received"][method]
            row["bytes_returned"][f"{who}.{method}"] = log["returned"][method]
    steps = max(1, row["steps"])
    row["calls_per_step"] = round(sum(row["calls"].values()) / steps, 2)
    row["bytes_per_step"] = round((sum(row["bytes_sent"].values()) + sum(row["bytes_returned"].values())) / steps)
    return row, output


def main(argv: list[str] | None = None) -> int:
    from tests.tiny_models import make_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size [default: Qwen2.5's, 151936]")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="specdec-wire-")
    target = make_model(f"{work}/target", "llama", vocab_size=args.vocab, seed=41)
    draft = make_model(f"{work}/draft", perturb_from=target, noise=0.03, seed=42)
    prompt = [(7 * i) % 90 + 3 for i in range(args.prompt_tokens)]
    ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False)
    rows = {}
    try:
        for tp in (1, 2):
            for name, sampling in {"greedy": SamplingParams(max_tokens=32),
                                   "sampled": SamplingParams(max_tokens=32, temperature=1.0, seed=3)}.items():
                row, _ = measure(target, draft, tp, prompt, sampling)
                rows[f"tp{tp} {name}"] = row
                print(f"tp{tp} {name}: {row['calls_per_step']} calls and {row['bytes_per_step']} bytes per step; "
                      f"{json.dumps(row['calls'])}", flush=True)
    finally:
        ray.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": args.vocab, "prompt_tokens": args.prompt_tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
