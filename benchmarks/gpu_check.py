"""`python -m benchmarks.gpu_check`: the checks only a GPU can run, in one script, one table.

Run it whenever a GPU is at hand (under 5 minutes on one GPU); without one it runs the same checks
on the CPU (`--device cpu`, what CI runs: the script stays runnable). Nothing here downloads: tiny
models are built from configs; the Qwen pair is timed only where its presets are already cached.

Checks (each a row: check, device, result, figure):
- every tiny decoder family, greedy speculative decoding on the device = HF `generate()` on the
  same device, token for token;
- `logit_bias` and a penalty on the device (tensors built on the logits' device), = HF's processors;
- the flat batch's one-call (varlen) attention against its per-row path for 1-32 rows: equal, timed;
- Gumbel noise (invariant sampling) on the CPU and on the device: bit-equal;
- the Qwen pair, speculative vs HF `generate()` target-only on the same device, tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _row(rows: list, check: str, device: str, ok: bool | None, figure: str = "") -> None:
    rows.append((check, device, "pass" if ok else ("skip" if ok is None else "FAIL"), figure))
    print(f"  {check}: {rows[-1][2]} {figure}", file=sys.stderr, flush=True)


def families(device: str, rows: list, names: list[str] | None, tokens: int = 24) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import FAMILIES, make_family_pair
    from transformers import AutoModelForCausalLM

    from specdec import SamplingParams, SpeculativeEngine

    prompts = [[5, 6, 7, 8, 9], [10, 20, 30, 10, 20, 30, 10, 20, 11, 12, 13]]
    with tempfile.TemporaryDirectory() as tmp:
        for family in names or list(FAMILIES):
            start = time.perf_counter()
            try:
                target, draft = make_family_pair(Path(tmp) / family, family)
                engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4,
                                                           device=device, draft_precision="none",
                                                           target_precision="float32")
                outs = [engine.generate(prompt_token_ids=p, sampling=SamplingParams(max_tokens=tokens)) for p in prompts]
                engine.shutdown()
                model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
                with torch.no_grad():
                    hf = [model.generate(torch.tensor([p], device=device), max_new_tokens=tokens,
                                         do_sample=False)[0, len(p):].tolist() for p in prompts]
                ok = [o.token_ids for o in outs] == hf
                accepted = sum(o.speculative.num_accepted_tokens for o in outs)
                _row(rows, f"greedy = HF generate: {family}", device, ok,
                     f"{accepted} accepted, {time.perf_counter() - start:.1f}s")
            except Exception as e:  # noqa: BLE001 - one family's failure is a row, not the end
                _row(rows, f"greedy = HF generate: {family}", device, False, f"{type(e).__name__}: {e}"[:120])


def logits_processing(device: str, rows: list) -> None:
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    from specdec.config import SamplingParams
    from specdec.decoding.logits_processing import process

    torch.manual_seed(0)
    logits = torch.randn(1, 96, device=device)
    prefix = [3, 4, 5, 4]
    sampling = SamplingParams(logit_bias={7: 3.0, 12: -100.0}, repetition_penalty=1.3)
    try:
        ours = process(logits, sampling, prefix)
        hf = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3),
                                  SequenceBiasLogitsProcessor({(7,): 3.0, (12,): -100.0})])(
            torch.tensor([prefix], device=device), logits.clone())
        ok = ours.device.type == torch.device(device).type and torch.allclose(ours, hf, atol=1e-5)
        _row(rows, "logit_bias + repetition penalty on the device = HF processors", device, ok,
             f"max diff {float((ours - hf).abs().max()):.1e}")
    except Exception as e:  # noqa: BLE001
        _row(rows, "logit_bias + repetition penalty on the device = HF processors", device, False, str(e)[:120])


def attention(device: str, rows: list, repeats: int = 5) -> None:
    """The flat batch's one-call attention (`flat_batch.VARLEN_KERNELS`: FlashAttention's varlen on
    CUDA, bfloat16) against its per-row path, for a verify step (5 new tokens per row on a cached
    prefix of 40-133 tokens) of 1, 8 and 32 rows: equal, and both timed (median of `repeats`). On a
    device without a kernel the contract's plain-PyTorch reference stands in (what CI runs)."""
    from contextlib import contextmanager

    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import make_model

    import specdec.models.flat_batch as flat_batch
    from specdec.models.loading import load_model
    from specdec.models.model_runner import ModelRunner

    kind = torch.device(device).type
    kernel = flat_batch.VARLEN_KERNELS.get(kind)
    dtype = "bfloat16" if kernel is not None else "float32"
    if kernel is None:
        kernel = flat_batch.VarlenKernel("reference", flat_batch.varlen_reference, (torch.float32,))

    @contextmanager
    def kernels(on: bool):
        saved = dict(flat_batch.VARLEN_KERNELS)
        flat_batch.VARLEN_KERNELS.clear()
        if on:
            flat_batch.VARLEN_KERNELS[kind] = kernel
        try:
            yield
        finally:
            flat_batch.VARLEN_KERNELS.clear()
            flat_batch.VARLEN_KERNELS.update(saved)

    def sync():
        if kind == "cuda":
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "attn", "llama", vocab_size=96, seed=5, context=1024)
        runner = ModelRunner(load_model(str(path), device=device, dtype=dtype))
        for n in (1, 8, 32):
            prompts = [[(7 * i + j) % 90 + 3 for j in range(40 + 3 * i)] for i in range(n)]
            caches = [runner.new_cache() for _ in prompts]
            runner.forward(caches, prompts, [1] * n)
            held = [len(c) for c in caches]
            results = {}
            flat_batch._checked.clear()
            for on in (False, True):
                with kernels(on):
                    times = []
                    for _ in range(repeats + 1):  # the first also runs the kernel's first-batch check
                        for cache, length in zip(caches, held):
                            cache.rewind(length)
                        sync()
                        start = time.perf_counter()
                        out = runner.forward(caches, [[3, 4, 5, 6, 7]] * n, [5] * n)
                        sync()
                        times.append(time.perf_counter() - start)
                    results[on] = (torch.stack([o.float() for o in out]), sorted(times[1:])[len(times[1:]) // 2])
            # The kernel must have been trusted by its first-batch check, not replaced by the per-row path.
            verdicts = [v for k, v in flat_batch._checked.items() if k[0] == kernel.name]
            diff = float((results[True][0] - results[False][0]).abs().max())
            scale = float(results[False][0].abs().max())
            ok = bool(verdicts) and all(verdicts) and diff <= (1e-4 if dtype == "float32" else 3e-2) * max(1.0, scale)
            _row(rows, f"{kernel.name} attention = per-row, {n} rows ({dtype})", device, ok,
                 f"max diff {diff:.1e}; step {results[True][1] * 1000:.1f} ms vs per-row {results[False][1] * 1000:.1f} ms")


def gumbel(device: str, rows: list) -> None:
    from specdec.decoding.sampling import gumbel_noise

    ids = torch.arange(152_064)
    cpu = gumbel_noise(1234, 567, ids)
    there = gumbel_noise(1234, 567, ids.to(device)).cpu()
    _row(rows, "Gumbel noise on the CPU and the device: bit-equal", device, bool(torch.equal(cpu, there)),
         f"{ids.numel()} tokens")


def qwen(device: str, rows: list, tokens: int = 128) -> None:
    from specdec import SamplingParams, SpeculativeEngine
    from specdec.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.models.model_cache import check

    if not all(check(name)[0] == "ok" for name in (DEFAULT_TARGET, DEFAULT_DRAFT)):
        _row(rows, "Qwen pair: speculative vs HF generate", device, None,
             "presets not cached here (`specdec models pull`; the GPU machine has no network)")
        return
    prompt = "def quicksort(xs):\n    \"\"\"Sort a list of integers.\"\"\"\n"
    engine = SpeculativeEngine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, num_speculative_tokens="auto",
                                               device=device)
    engine.generate(prompt, sampling=SamplingParams(max_tokens=8))  # warm
    start = time.perf_counter()
    out = engine.generate(prompt, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
    spec = out.completion_tokens / (time.perf_counter() - start)
    model = engine.target_model.model
    ids = torch.tensor([engine.tokenize(prompt)], device=device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False)
        start = time.perf_counter()
        hf = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    base = (hf.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
    same = out.token_ids == hf[0, ids.shape[1]:].tolist()
    engine.shutdown()
    _row(rows, "Qwen pair: speculative vs HF generate", device, same,
         f"{spec:.1f} vs {base:.1f} tok/s ({spec / base:.2f}x), target {engine.target_precision}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="cuda, cuda:N or cpu [default: cuda if present]")
    parser.add_argument("--families", default=None, help="comma-separated families [default: all]")
    parser.add_argument("--no-qwen", action="store_true", help="skip the Qwen pair")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(f"gpu_check on {device} ({name}), torch {torch.__version__}", file=sys.stderr)
    rows: list = []
    started = time.perf_counter()
    families(device, rows, args.families.split(",") if args.families else None)
    logits_processing(device, rows)
    attention(device, rows)
    gumbel(device, rows)
    if not args.no_qwen:
        qwen(device, rows)
    print(f"| check | device | result | figure |\n|---|---|---|---|")
    for check, dev, result, figure in rows:
        print(f"| {check} | {dev} | {result} | {figure} |")
    print(f"\n{sum(r[2] == 'pass' for r in rows)} pass, {sum(r[2] == 'FAIL' for r in rows)} fail, "
          f"{sum(r[2] == 'skip' for r in rows)} skipped in {time.perf_counter() - started:.0f}s on {name}")
    return 1 if any(r[2] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
