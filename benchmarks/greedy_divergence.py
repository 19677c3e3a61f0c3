"""How often greedy text differs from Hugging Face `generate()`, and how often HF differs from itself.

For a target (a tiny random model, or a real one by path) in float32 and bfloat16, over N prompts
x T tokens, greedy:
- `hf_batch4`: HF `generate()` on the prompt inside a left-padded batch of 4 vs the prompt alone
  (the target's own numeric noise: other shapes, other kernels);
- `specdec_alone`: specdec, one request at a time, vs HF alone;
- `specdec_batched`: specdec with 8 requests at once vs HF alone.
A prompt counts as diverged when any of its T tokens differs; the first differing index is kept.

    python -m benchmarks.greedy_divergence --target tiny --out docs/bench/greedy-divergence.json
    python -m benchmarks.greedy_divergence --target ~/.cache/specdec/models/smollm2-135m-instruct --draft ngram
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from specdec.config import EngineConfig
from specdec.options import add_arguments


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _summary(name: str, got: list[list[int]], want: list[list[int]]) -> dict:
    firsts = [_first_difference(g, w) for g, w in zip(got, want)]
    diverged = [f for f in firsts if f is not None]
    return {"comparison": name, "prompts": len(want), "diverged": len(diverged),
            "rate": round(len(diverged) / len(want), 4), "first_difference_at": sorted(diverged)}


def _hf(model, prompts: list[list[int]], tokens: int, batch: int, pad_id: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            group = prompts[start:start + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                 pad_token_id=pad_id)
            out += gen[:, width:].tolist()
    return out


def measure(target: Path, draft: str, dtype: str, prompts: list[list[int]], tokens: int, k: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from specdec import SamplingParams, SpeculativeEngine

    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    pad_id = model.generation_config.pad_token_id or model.config.pad_token_id or 0
    # Exactly T argmax tokens, EOS included (as specdec's ignore_eos). Not `min_new_tokens`: that
    # masks EOS, so HF would take the runner-up wherever the model's argmax is EOS.
    model.generation_config.eos_token_id = None
    alone = _hf(model, prompts, tokens, 1, pad_id)
    batch4 = _hf(model, prompts, tokens, 4, pad_id)
    del model
    engine = SpeculativeEngine.from_pretrained(str(target), draft=draft, dtype=dtype, num_speculative_tokens=k,
                                               draft_precision="none")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    spec_alone = [engine.generate(prompt_token_ids=p, sampling=params).token_ids for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        spec_batched = list(pool.map(lambda p: engine.generate(prompt_token_ids=p, sampling=params).token_ids,
                                     prompts))
    engine.shutdown()
    return [_summary("hf_batch4_vs_hf_alone", batch4, alone),
            _summary("specdec_alone_vs_hf_alone", spec_alone, alone),
            _summary("specdec_batched_vs_hf_alone", spec_batched, alone)]


def tiny_pair(num_prompts: int) -> tuple[Path, Path, list[list[int]]]:
    """A tiny random Llama (vocab 512), a draft perturbed from it, and random prompts of 4-39 tokens."""
    from tests.tiny_models import make_model

    g = torch.Generator().manual_seed(0)
    root = Path(tempfile.mkdtemp())
    target = make_model(root / "target", "llama", vocab_size=512, seed=1, eos_token_id=None, hidden=64, layers=2)
    draft = make_model(root / "draft", perturb_from=target, noise=0.05, seed=2)
    prompts = [torch.randint(5, 500, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 40, (num_prompts,), generator=g)]
    return target, draft, prompts


def report(title: str, rows: list[dict]) -> None:
    print(f"{title}:", flush=True)
    for row in rows:
        print(f"  {row['comparison']}: {row['diverged']}/{row['prompts']} diverged "
              f"(first differences at {row['first_difference_at'][:8]})", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tiny", help="a model directory, or 'tiny' (a random Llama + draft)")
    parser.add_argument("--draft", default=None, help="draft spec (default: the tiny draft, or ngram)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    add_arguments(parser, EngineConfig, only=("num_speculative_tokens",))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from specdec.kernels.cpu import cpu_info

    if args.target == "tiny":
        target, tiny_draft, prompts = tiny_pair(args.prompts)
        draft = args.draft or str(tiny_draft)
    else:
        from transformers import AutoTokenizer

        from benchmarks.prompts import humaneval

        target, draft = Path(args.target).expanduser(), args.draft or "ngram"
        tok = AutoTokenizer.from_pretrained(target)
        prompts = [tok(p.text)["input_ids"] for p in humaneval(args.prompts)]
    result = {"target": str(args.target), "draft": "tiny draft" if args.target == "tiny" and not args.draft else draft,
              "num_speculative_tokens": args.num_speculative_tokens, "prompts": len(prompts), "tokens": args.tokens,
              "cpu": cpu_info().as_dict(),
              "python": platform.python_version(), "torch": torch.__version__, "runs": {}}
    for dtype in args.dtypes.split(","):
        started = time.perf_counter()
        result["runs"][dtype] = measure(target, draft, dtype, prompts, args.tokens, args.num_speculative_tokens)
        report(f"{dtype} ({time.perf_counter() - started:.0f}s)", result["runs"][dtype])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
