"""`specdec bench --concurrency 1,2,4,8`: throughput and latency under concurrent load.

For each concurrency N, N closed-loop clients (a client sends its next prompt when its last one
returns) share the bench prompts and send them to:
- `specdec-batched`: the in-process engine, its scheduler batching up to N requests per step;
- `ray`: the Ray engine (tp=1), its coordinator batching the same way;
- `specdec-unbatched`: the same in-process engine with `max_batch_size=1` (requests interleave,
  one per step: the engine before batching);
- `hf-static`: Hugging Face `generate()` target-only on static batches of N prompts (left padding):
  what a user would otherwise run for a batch.
Reported per method and N: aggregate tokens/s (all tokens over the wall time of the whole load),
per-request latency p50/p99, time to first token p50 (specdec: the first streamed chunk; HF: the
batch's time, it streams nothing), mean K and acceptance, and how many requests' greedy tokens
equal target-only HF `generate()` of the prompt alone (the N=1 HF run).
"""

from __future__ import annotations

import gc
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.report import cpu_line
from specdec.config import SamplingParams
from specdec.kernels.cpu import cpu_info
from specdec.kernels.linear import stock_linears
from specdec.decoding.stats import SpeculativeStats


@dataclass
class Load:
    """What one method did at one concurrency."""

    method: str
    concurrency: int
    seconds: float = 0.0
    tokens: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> generated ids
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    mean_batch: float | None = None

    def row(self, reference: dict[int, list[int]] | None) -> dict:
        total = sum(len(t) for t in self.tokens.values())
        row = {"method": self.method, "concurrency": self.concurrency, "requests": len(self.tokens),
               "tokens": total, "seconds": round(self.seconds, 2),
               "tokens_per_second": round(total / self.seconds, 3) if self.seconds else 0.0,
               "latency_p50": _pct(self.latencies, 50), "latency_p99": _pct(self.latencies, 99),
               "ttft_p50": _pct(self.ttfts, 50), "mean_batch": self.mean_batch}
        s = self.stats
        row["mean_k"] = round(s.num_draft_tokens / s.target_forwards, 3) if s.target_forwards else None
        row["acceptance_rate"] = round(s.acceptance_rate, 4) if s.num_draft_tokens else None
        if reference is not None:
            row["identical_to_target_only"] = sum(self.tokens.get(i) == ref for i, ref in reference.items())
        return row


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 3)


def closed_loop(engine, method: str, prompt_ids: list[list[int]], sampling: SamplingParams, n: int,
                on_done=None, **request) -> Load:
    """N clients, each streaming its next prompt from a shared queue until none is left."""
    load = Load(method, n)
    work: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(prompt_ids)):
        work.put(i)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client():
        while True:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            try:
                start, first, ids, out = time.perf_counter(), None, [], None
                for chunk in engine.generate_stream(prompt_token_ids=prompt_ids[i], sampling=sampling, **request):
                    first = first or time.perf_counter()
                    ids += chunk.token_ids
                    out = chunk.output or out
                end = time.perf_counter()
            except BaseException as e:  # noqa: BLE001 - reported after the load
                errors.append(e)
                return
            with lock:
                load.tokens[i] = ids
                load.latencies.append(end - start)
                load.ttfts.append((first or end) - start)
                if out is not None:
                    load.stats.merge(out.speculative)
            if on_done:
                on_done()

    threads = [threading.Thread(target=client) for _ in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    load.seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    return load


def hf_static(model, prompt_ids: list[list[int]], sampling: SamplingParams, n: int, eos_token_ids,
              pad_id: int, on_done=None) -> Load:
    """Target-only `generate()` on static batches of N prompts, left padded (greedy)."""
    load = Load("hf-static", n)
    eos = sorted(eos_token_ids)
    started = time.perf_counter()
    for lo in range(0, len(prompt_ids), n):
        batch = prompt_ids[lo : lo + n]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        with torch.inference_mode(), stock_linears(model):
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=sampling.max_tokens, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, eos_token_id=eos or None, pad_token_id=pad_id)
        seconds = time.perf_counter() - t0
        for j, row in enumerate(out[:, width:].tolist()):
            load.tokens[lo + j] = _until_eos(row, eos)
            load.latencies.append(seconds)
            load.ttfts.append(seconds)
            if on_done:
                on_done()
    load.seconds = time.perf_counter() - started
    return load


def _until_eos(ids: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def run(target_spec: str, draft_spec: str, prompt_ids: list[list[int]], sampling: SamplingParams,
        levels: tuple[int, ...], out_dir: Path, max_speculative_tokens: int = 8, num_threads: int | None = None,
        ray: bool = True, hf: bool = True, command: str = "") -> tuple[list[dict], dict[str, Path]]:
    from tqdm.auto import tqdm

    from specdec import EngineConfig, SpeculativeEngine
    from specdec.models.loading import load_model, set_threads

    set_threads(num_threads)
    started = time.time()
    target, draft = load_model(target_spec), load_model(draft_spec)
    config = EngineConfig(target=target_spec, draft=draft_spec, num_speculative_tokens="auto",
                          max_speculative_tokens=max_speculative_tokens, num_threads=num_threads,
                          max_batch_size=max(levels), target_precision="float32")  # HF's batches run these weights
    engine = SpeculativeEngine(config, target, draft)
    pad = (target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None
           else sorted(target.eos_token_ids)[0])
    methods = (["hf-static"] if hf else []) + ["specdec-batched", "specdec-unbatched"]
    loads: list[Load] = []
    total = len(levels) * (len(methods) + ray) * len(prompt_ids)
    with tqdm(total=total, desc="bench --concurrency", unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        # Phase 1, in this process. Warm every path once (kernels, allocator pools) on a short prompt.
        engine.generate(prompt_token_ids=prompt_ids[0][:32], sampling=SamplingParams(max_tokens=8))
        for n in levels:
            for method in methods:
                bar.set_postfix_str(f"N={n} {method}")
                if method == "hf-static":
                    load = hf_static(target.model, prompt_ids, sampling, n, target.eos_token_ids, pad, bar.update)
                else:
                    engine.scheduler.max_batch_size = n if method == "specdec-batched" else 1
                    before = dict(engine.scheduler.batch_sizes)
                    load = closed_loop(engine, method, prompt_ids, sampling, n, bar.update)
                    load.mean_batch = _mean_batch(dict(engine.scheduler.batch_sizes), before)
                loads.append(load)
        info = {"linear_kernel": engine.linear_kernel, "draft_precision": engine.draft_precision}
        if ray:
            # Phase 2: the Ray engine, with the in-process models freed (both do not fit in 24 GB).
            engine.shutdown()
            del engine, target, draft
            gc.collect()
            loads += _ray_phase(config, prompt_ids, sampling, levels, num_threads, bar)
    reference = next((l.tokens for l in loads if l.method == "hf-static" and l.concurrency == 1), None)
    if not sampling.greedy:
        reference = None
    rows = [load.row(reference) for load in loads]
    meta = {"target": target_spec, "draft": draft_spec, "num_prompts": len(prompt_ids),
            "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "concurrency": list(levels),
            "threads": torch.get_num_threads(), **info, "cpu": cpu_info().as_dict(), "torch": torch.__version__,
            "seconds": round(time.time() - started, 1), "command": command,
            "reference": "hf-static at N=1 (target-only generate() of each prompt alone)" if reference else None}
    return rows, write(out_dir, rows, meta)


def _ray_phase(config, prompt_ids, sampling, levels, threads, bar) -> list[Load]:
    from actors import RayEngineConfig, RolePlacement, build_ray_engine

    role = RolePlacement(num_threads=threads or torch.get_num_threads())
    ray_engine = build_ray_engine(RayEngineConfig(engine=config, tp=1, draft_role=role, target_role=role))
    loads = []
    try:
        ray_engine.generate(prompt_token_ids=prompt_ids[0][:32], sampling=SamplingParams(max_tokens=8))
        for n in levels:
            bar.set_postfix_str(f"N={n} ray")
            before = _ray_batches(ray_engine)
            load = closed_loop(ray_engine, "ray", prompt_ids, sampling, n, bar.update)
            load.mean_batch = _mean_batch(_ray_batches(ray_engine), before)
            loads.append(load)
    finally:
        ray_engine.shutdown()
    return loads


def _ray_batches(ray_engine) -> dict:
    import ray

    return {int(k): v for k, v in ray.get(ray_engine.coordinator.batch_sizes.remote()).items()}


def _mean_batch(after: dict, before: dict) -> float | None:
    steps = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    count = sum(steps.values())
    return round(sum(k * v for k, v in steps.items()) / count, 2) if count else None


COLUMNS = [("method", "method", None), ("N", "concurrency", None), ("tok/s", "tokens_per_second", ".2f"),
           ("latency p50 s", "latency_p50", ".2f"), ("latency p99 s", "latency_p99", ".2f"),
           ("TTFT p50 s", "ttft_p50", ".2f"), ("mean batch", "mean_batch", ".2f"), ("mean K", "mean_k", ".2f"),
           ("acceptance", "acceptance_rate", ".3f"), ("= target-only", "identical_to_target_only", None)]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# specdec bench --concurrency: {meta['target']} + {meta['draft']}", "",
             f"{meta['num_prompts']} prompts, {meta['max_tokens']} new tokens, temperature {meta['temperature']}, "
             f"{meta['threads']} threads, target kernel {meta['linear_kernel']}, draft {meta['draft_precision']}; "
             f"closed loop (a client sends its next prompt when its last returns). `{meta['command']}`", "",
             f"CPU: {cpu_line(meta)}.", "",
             "| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for _, key, spec in COLUMNS:
            value = row.get(key)
            if value is None:
                cells.append("-")
            elif key == "identical_to_target_only":
                cells.append(f"{value}/{row['requests']}")
            else:
                cells.append(format(value, spec) if spec else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    ratios = _ratios(rows)
    if ratios:
        lines += ["", "Ratios of aggregate tokens/s: " + "; ".join(ratios)]
    return "\n".join(lines) + "\n"


def _ratios(rows: list[dict]) -> list[str]:
    by = {(r["method"], r["concurrency"]): r["tokens_per_second"] for r in rows}
    out = []
    for n in sorted({r["concurrency"] for r in rows}):
        batched = by.get(("specdec-batched", n))
        for other in ("hf-static", "specdec-unbatched", "ray"):
            if batched and by.get((other, n)):
                label = "ray/specdec-batched" if other == "ray" else f"specdec-batched/{other}"
                value = by[(other, n)] / batched if other == "ray" else batched / by[(other, n)]
                out.append(f"N={n} {label} {value:.2f}x")
    return out


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r["concurrency"], r["tokens_per_second"]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    levels = sorted({r["concurrency"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out_dir: Path, rows: list[dict], meta: dict) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench-concurrency.json", "markdown": out_dir / "bench-concurrency.md"}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": rows}, indent=2))
    paths["markdown"].write_text(markdown(rows, meta))
    paths["plot"] = plot(rows, out_dir / "throughput_vs_concurrency.png")
    return paths

