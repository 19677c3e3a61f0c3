"""Running a benchmark: every method on the same prompts, interleaved prompt by prompt so machine
drift hits every method alike.

Phase 1, in one process: Hugging Face target-only `generate()` (the baseline), HF assisted
generation with the same draft, HF prompt lookup, and specdec's in-process engine (target-only,
a K sweep, auto K, n-gram). All share one copy of the target's weights: HF methods run on the
stock kernels, specdec on its prepacked ones.

Phase 2 (Ray), per tensor-parallel size and draft placement: the Ray engine with the draft
colocated in the rank-0 shard, and with the draft in its own actor (pipelining off and on), each
paired prompt by prompt with the in-process engine at the same settings, so the Ray path's overhead is measured
on one machine state. To fit both in memory, the in-process target then drops its MKL copy of
the weights (oneDNN only) and the Ray shards use the same kernel.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.methods import HFGenerate, Run, Specdec
from benchmarks.prompts import Prompt
from benchmarks import report
from specdec import EngineConfig, SamplingParams, SpeculativeEngine
from specdec.kernels.cpu import cpu_info
from specdec.kernels.linear import PackedLinear
from specdec.models.loading import load_model, set_threads
from specdec.engine.prompt import check_prompt, tokenize_prompt

logger = logging.getLogger(__name__)

BASELINE = "hf"
REFERENCE = "specdec-none"


RAY_PLACEMENTS = ("colocated", "separate")  # actors.config.DRAFT_PLACEMENTS less "auto"


def check_ray_placements(placements) -> None:
    bad = [p for p in placements if p not in RAY_PLACEMENTS]
    if bad or not placements:
        raise ValueError(f"--ray-placement: draft placements are colocated and/or separate, got {','.join(bad)!r}")


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str
    prompts: tuple[Prompt, ...]
    prompts_source: str
    sampling: SamplingParams = SamplingParams(max_tokens=128)
    k_sweep: tuple[int, ...] = (1, 2, 4, 6, 8)
    max_speculative_tokens: int = 8
    hf: bool = True
    ngram: bool = True
    ray_tps: tuple[int, ...] = (1, 2)
    ray_placements: tuple[str, ...] = RAY_PLACEMENTS
    num_threads: int | None = None
    # The draft levers, each a row on the same prompts: fixed draft precisions, reduced draft
    # vocabularies (FR-Spec), prompt lookup in front of the draft, and a hopeless (random-init) draft.
    precisions: tuple[str, ...] = ()
    draft_vocabs: tuple[int, ...] = ()
    prompt_lookup_mins: tuple[int, ...] = ()
    hopeless: int = 0  # prompts for the random-init draft vs target-only phase (0: skip)
    sampling_modes: tuple[str, ...] = ()  # also run specdec-auto in each sampling mode (sampled runs)
    hf_prompt_lookup: bool = True
    chat: bool = False
    out_dir: Path = Path("bench-results")
    warmup: bool = True

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no prompts to benchmark")
        if any(k < 1 for k in self.k_sweep):
            raise ValueError(f"every K of the sweep must be >= 1, got {self.k_sweep}")
        if any(tp < 1 for tp in self.ray_tps):
            raise ValueError(f"every tensor parallel size must be >= 1, got {self.ray_tps}")
        if self.ray_tps:
            check_ray_placements(self.ray_placements)
        from specdec.config import DRAFT_PRECISIONS, SAMPLING_MODES

        unknown = [m for m in self.sampling_modes if m not in SAMPLING_MODES]
        if unknown:
            raise ValueError(f"unknown sampling mode(s) {', '.join(unknown)}: use {', '.join(SAMPLING_MODES)}")
        if self.sampling_modes and self.sampling.greedy:
            raise ValueError("--sampling-modes compares sampled runs: give --temperature > 0")
        bad = [p for p in self.precisions if p not in DRAFT_PRECISIONS or p == "auto"]
        if bad:
            raise ValueError(f"--precisions: each is one of none, bfloat16, int8, int8-weight; got {','.join(bad)}")
        if any(n < 1 for n in self.draft_vocabs) or any(n < 1 for n in self.prompt_lookup_mins) or self.hopeless < 0:
            raise ValueError("--draft-vocabs and --prompt-lookup-mins take integers >= 1, --hopeless one >= 0")
        if self.draft in ("none", "ngram"):
            raise ValueError("the benchmark needs a draft model (n-gram lookup is always included)")


@dataclass
class Results:
    runs: dict[str, list[Run | None]] = field(default_factory=dict)
    ks: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)
    paired: dict[str, str] = field(default_factory=dict)  # ray method -> its in-process pair

    def add(self, method, index: int, run: Run, num_prompts: int) -> None:
        self.runs.setdefault(method.name, [None] * num_prompts)[index] = run
        self.ks[method.name] = method.k
        self.groups[method.name] = method.group


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


def _interleave(methods, prompt_ids, sampling, results: Results, desc: str) -> None:
    n = len(prompt_ids)
    with _progress(n * len(methods), desc) as bar:
        for i, ids in enumerate(prompt_ids):
            # Rotate the order each prompt so no method always runs first (cold caches) or last.
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for method in order:
                bar.set_postfix_str(method.name)
                sampled = sampling.replace(seed=sampling.seed if sampling.seed is not None else i)
                results.add(method, i, method.run(ids, sampled), n)
                bar.update()


def _warm(methods, ids) -> None:
    for method in methods:
        method.run(ids[:16], SamplingParams(max_tokens=4))


def run(config: BenchConfig) -> tuple[list[dict], dict[str, Path]]:
    set_threads(config.num_threads)
    started = time.time()
    target = load_model(config.target)
    draft = load_model(config.draft)
    sampling = config.sampling
    prompt_ids = [check_prompt(tokenize_prompt(target.tokenizer, p.text, config.chat), sampling, target.vocab_size,
                               target.max_context) for p in config.prompts]
    engine_config = EngineConfig(target=config.target, draft=config.draft, num_speculative_tokens="auto",
                                 max_speculative_tokens=config.max_speculative_tokens, num_threads=config.num_threads)
    spec = SpeculativeEngine(engine_config, target, draft)
    plain = SpeculativeEngine(EngineConfig(target=config.target, draft="none"), target)
    eos = target.eos_token_ids
    methods = []
    if config.hf:
        methods += [HFGenerate(BASELINE, target.model, eos),
                    HFGenerate("hf-assisted", target.model, eos, assistant_model=draft.model)]
        if config.hf_prompt_lookup:
            methods.append(HFGenerate("hf-prompt-lookup", target.model, eos, prompt_lookup_num_tokens=10))
    methods.append(Specdec(REFERENCE, plain, None))
    methods += [Specdec(f"specdec-k{k}", spec, k) for k in config.k_sweep]
    methods.append(Specdec("specdec-auto", spec, "auto"))  # the defaults; its draft: meta["draft_precision"]
    methods += [Specdec(f"specdec-auto ({mode})", spec, "auto", group="sampling", sampling_mode=mode)
                for mode in config.sampling_modes]
    methods += _lever_methods(config, engine_config, target, draft)
    if config.ngram:
        ngram = SpeculativeEngine(dataclasses.replace(engine_config, draft="ngram"), target)
        methods.append(Specdec("specdec-ngram", ngram, "auto"))
    baseline = BASELINE if config.hf else REFERENCE
    results = Results()
    if config.warmup:
        _warm(methods, prompt_ids[0])
    _interleave(methods, prompt_ids, sampling, results, "bench")

    if config.hopeless:
        methods = [m for m in methods if getattr(m, "engine", None) is spec]  # free the levers' drafts (memory)
        gc.collect()
        _hopeless_phase(config, engine_config, target, draft, plain, prompt_ids[:config.hopeless], sampling, results)

    if config.ray_tps:
        del methods, plain
        draft = None
        gc.collect()
        if spec.linear_kernel == "onednn":  # hybrid and torch still run the original weights
            _drop_mkl_weights(target.model)  # room for the Ray actors' copy of the target
        for tp in config.ray_tps:
            for placement in config.ray_placements:
                _ray_phase(config, tp, placement, spec, prompt_ids, sampling, results)

    rows = report.summarize(results.runs, baseline, REFERENCE, results.ks, results.groups, sampling.greedy)
    for row in rows:
        pair = results.paired.get(row["method"])
        if pair:
            mine, theirs = results.runs[row["method"]], results.runs[pair]
            ratios = [a.tokens_per_second / b.tokens_per_second for a, b in zip(mine, theirs) if a and b]
            row["vs_in_process"] = sorted(ratios)[len(ratios) // 2] if ratios else None
    meta = {
        "target": config.target, "draft": config.draft, "prompts": config.prompts_source,
        "num_prompts": len(config.prompts), "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k,
        "speculative_sampling_default": spec.config.speculative_sampling, "chat": config.chat, "baseline": baseline,
        "device": str(target.device), "threads": torch.get_num_threads(), "linear_kernel": spec.linear_kernel,
        "draft_precision": spec.draft_precision,
        "draft_calibration": [dataclasses.asdict(m) for m in spec.draft_calibration],
        "calibration": spec.calibration,  # what auto measured for the kernel and the draft, and when
        "cpu": cpu_info().as_dict(), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(), "seconds": round(time.time() - started, 1),
        "command": " ".join(sys.argv),
    }
    per_prompt = {name: [None if r is None else {"tokens": len(r.token_ids), "seconds": round(r.seconds, 4),
                                                 "tokens_per_second": round(r.tokens_per_second, 3)}
                         for r in method_runs] for name, method_runs in results.runs.items()}
    return rows, report.write(config.out_dir, rows, meta, per_prompt)


def _lever_methods(config: BenchConfig, engine_config: EngineConfig, target, draft) -> list:
    """One auto-K row per lever. Fixed precisions share one prepared copy of the draft each; the
    vocabulary and prompt-lookup rows run on the bfloat16 draft (or the first precision asked)."""
    from specdec.kernels.draft_precision import prepare_draft

    methods, prepared = [], {}
    for precision in config.precisions:
        model = prepare_draft(draft.model, precision)
        prepared[precision] = dataclasses.replace(draft, model=model) if model is not draft.model else draft
        engine = SpeculativeEngine(dataclasses.replace(engine_config, draft_precision="none"), target,
                                   prepared[precision])
        methods.append(Specdec(f"specdec-auto (draft {precision})", engine, "auto", group="precision"))
    base_precision = "bfloat16" if "bfloat16" in prepared else (config.precisions[0] if config.precisions else "auto")
    base = prepared.get(base_precision, draft)
    as_prepared = "none" if base is not draft else engine_config.draft_precision
    for n in config.draft_vocabs:  # a prepared (packed) model cannot be copied: prepare from the loaded one
        engine = SpeculativeEngine(dataclasses.replace(engine_config, draft_vocab_size=n,
                                                       draft_precision=base_precision), target, draft)
        methods.append(Specdec(f"specdec-auto (draft {base_precision}, vocab {engine.draft_vocab_size})", engine,
                               "auto", group="vocab"))
    for n in config.prompt_lookup_mins:
        engine = SpeculativeEngine(dataclasses.replace(engine_config, draft_precision=as_prepared,
                                                       prompt_lookup_min=n), target, base)
        methods.append(Specdec(f"specdec-auto (draft {base_precision}, n-gram {n}+ first)", engine, "auto",
                               group="hybrid"))
    return methods


def _hopeless_phase(config: BenchConfig, engine_config: EngineConfig, target, draft, plain, prompt_ids,
                    sampling, results: Results) -> None:
    """A random-init draft of the real draft's shape (it agrees with the target by chance only) at
    the default settings, paired prompt by prompt with target-only decoding."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(draft.model.config, dtype=draft.dtype).eval()
    hopeless = SpeculativeEngine(engine_config, target, dataclasses.replace(draft, model=model, source="random-init"))
    methods = [Specdec(f"{REFERENCE} (pair of the random-init draft)", plain, None, group="hopeless"),
               Specdec(f"specdec-auto (random-init draft, {hopeless.draft_precision})", hopeless, "auto",
                       group="hopeless")]
    if config.warmup:
        _warm(methods, prompt_ids[0])
    _interleave(methods, prompt_ids, sampling, results, "bench random-init draft")
    results.paired[methods[1].name] = methods[0].name


def _drop_mkl_weights(model) -> None:
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.weight = None
    gc.collect()


def _ray_phase(config: BenchConfig, tp: int, placement: str, spec, prompt_ids, sampling, results: Results) -> None:
    from actors import RayEngineConfig, RolePlacement, build_ray_engine

    threads = config.num_threads or torch.get_num_threads()
    engine_config = EngineConfig(target=config.target, draft=config.draft, num_speculative_tokens="auto",
                                 max_speculative_tokens=config.max_speculative_tokens,
                                 linear_kernel="onednn" if tp == 1 else "auto")
    ray_engine = build_ray_engine(RayEngineConfig(
        engine=engine_config, tp=tp, draft_placement=placement,
        draft_role=RolePlacement(num_threads=threads),
        target_role=RolePlacement(num_threads=max(1, threads // tp))))
    try:
        name = f"ray-tp{tp}-{placement}"
        pair = Specdec(f"specdec-auto (pair of {name})", spec, "auto")
        methods = [pair, Specdec(name, ray_engine, "auto", group="ray", pipeline=False)]
        if placement == "separate":
            methods.append(Specdec(f"{name}-pipeline", ray_engine, "auto", group="ray", pipeline=True))
        if config.warmup:
            _warm(methods, prompt_ids[0])
        _interleave(methods, prompt_ids, sampling, results, f"bench {name}")
        for m in methods[1:]:
            results.paired[m.name] = pair.name
    finally:
        ray_engine.shutdown()
