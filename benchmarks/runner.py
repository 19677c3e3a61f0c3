"""Running a benchmark: every method on the same prompts, interleaved prompt by prompt so machine
drift hits every method alike.

Phase 1, in one process (`in-process`): Hugging Face target-only `generate()` (the baseline), HF
assisted generation with the same draft, HF prompt lookup, and specdec's in-process engine
(target-only, a K sweep, auto K, n-gram). All share one copy of the target's weights: HF methods
run on the stock kernels, specdec on its prepacked ones. Optionally (`random-init draft`), a
random-init draft paired with target-only decoding.

Phase 2 (Ray), per tensor-parallel size and draft placement (`ray-tp1-colocated`, ...): the Ray
engine with the draft colocated in the rank-0 shard, and with the draft in its own actor
(pipelining off and on), each paired with the in-process engine at the same settings, so the Ray
path's overhead is measured on one machine state: prompt by prompt where both fit in memory,
before and after the Ray engine where only one at a time does (`ray_phase.py` says why).

Memory (`memory.py`). Each phase is estimated before it starts and skipped, with a note in
bench.json's meta (`skipped`) and bench.md, when it cannot fit. A finished phase's engines are
shut down and dropped and the freed memory handed back to the OS before the next phase loads
anything; after phase 1 this process keeps only the Ray phases' pair (its target and draft).

Failures. A phase that raises (a Ray actor killed by the memory monitor, a bad value) is logged,
recorded in meta (`failed`), and the run goes on with the next phase. bench.json and bench.md are
written after every phase, so the rows measured so far survive even the death of this process,
and once more on Ctrl-C (meta `interrupted`) before it exits.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import memory, ray_phase, report
from benchmarks.methods import HFGenerate, Run, Specdec
from benchmarks.prompts import Prompt
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
    # The target at other precisions (int4, int8-weight): target-only and auto-K rows on a copy of its
    # own, each auto row paired with its own target-only row (speedup and token identity).
    target_precisions: tuple[str, ...] = ()
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
            raise ValueError(f"--precisions: each is one of none, float32, bfloat16, int8, int8-weight, int4; got "
                             f"{','.join(bad)}")
        from specdec.config import TARGET_PRECISIONS

        bad = [p for p in self.target_precisions if p not in TARGET_PRECISIONS or p in ("auto", "float32")]
        if bad:
            raise ValueError(f"--target-precisions: each is one of int4, int8-weight (float32 is the default "
                             f"rows); got {','.join(bad)}")
        if any(n < 1 for n in self.draft_vocabs) or any(n < 1 for n in self.prompt_lookup_mins) or self.hopeless < 0:
            raise ValueError("--draft-vocabs and --prompt-lookup-mins take integers >= 1, --hopeless one >= 0")
        if self.draft in ("none", "ngram"):
            raise ValueError("the benchmark needs a draft model (n-gram lookup is always included)")


@dataclass
class Results:
    """What a run measured so far, and what became of each phase."""

    runs: dict[str, list[Run | None]] = field(default_factory=dict)
    ks: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)
    paired: dict[str, str] = field(default_factory=dict)  # ray method -> its in-process pair
    engine: dict = field(default_factory=dict)  # what the in-process engine chose (kernel, draft precision)
    skipped: list[dict] = field(default_factory=list)  # {"phase", "reason"}: would not fit in memory
    failed: list[dict] = field(default_factory=list)  # {"phase", "error"}: raised
    ray_pairing: dict[str, str] = field(default_factory=dict)  # ray phase -> interleaved | before/after
    interrupted: bool = False
    started: float = field(default_factory=time.time)

    def add(self, method, index: int, run: Run, num_prompts: int) -> None:
        self.runs.setdefault(method.name, [None] * num_prompts)[index] = run
        self.ks[method.name] = method.k
        self.groups[method.name] = method.group

    def skip(self, phase: str, reason: str) -> None:
        logger.warning("skipping %s: %s", phase, reason)
        self.skipped.append({"phase": phase, "reason": reason})

    def measure(self, methods, prompt_ids, sampling: SamplingParams, desc: str, warmup: bool = True) -> None:
        """Every method on every prompt, interleaved prompt by prompt (after a short warm-up run each)."""
        if warmup:
            for method in methods:
                method.run(prompt_ids[0][:16], SamplingParams(max_tokens=4))
        n = len(prompt_ids)
        with _progress(n * len(methods), desc) as bar:
            for i, ids in enumerate(prompt_ids):
                # Rotate the order each prompt so no method always runs first (cold caches) or last.
                order = methods[i % len(methods):] + methods[: i % len(methods)]
                for method in order:
                    bar.set_postfix_str(method.name)
                    sampled = sampling.replace(seed=sampling.seed if sampling.seed is not None else i)
                    self.add(method, i, method.run(ids, sampled), n)
                    bar.update()


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


def run(config: BenchConfig) -> tuple[list[dict], dict[str, Path]]:
    """Every phase in turn; returns the summary rows and the paths of bench.json, bench.md and the
    plots. On Ctrl-C, writes what was measured and re-raises."""
    set_threads(config.num_threads)
    results = Results()
    pair = None
    try:
        pair, footprint, prompt_ids = _in_process_phases(config, results)
        memory.release()  # the in-process methods' engines went with the frames above
        for tp in config.ray_tps:
            for placement in config.ray_placements:
                _ray_phase(config, tp, placement, pair, footprint, prompt_ids, results)
    except KeyboardInterrupt:
        results.interrupted = True
        _, paths = _write(config, results)
        logger.warning("interrupted: what was measured is in %s", paths["json"])
        raise
    finally:
        if pair is not None:
            pair.release()
    return _write(config, results, plots=True)


def _attempt(config: BenchConfig, results: Results, phase: str, body: Callable[[], None]) -> None:
    """Run one phase. An exception is logged with its traceback and recorded (meta `failed`), and
    the run goes on; either way the rows measured so far are written (the next phase could kill
    this process). KeyboardInterrupt goes on up to `run`."""
    try:
        body()
    except Exception as e:  # noqa: BLE001 - recorded; the next phase may still run
        logger.warning("%s failed; going on with the next phase", phase, exc_info=True)
        results.failed.append({"phase": phase, "error": _one_line(e)})
    finally:
        memory.release()
    _write(config, results)


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _in_process_phases(config: BenchConfig,
                       results: Results) -> tuple[ray_phase.Pair, memory.Footprint, list[list[int]]]:
    """Phase 1 and the hopeless phase, on one copy of the target and the draft. Returns the Ray
    phases' pair (holding the engine at the defaults if there are Ray phases), the models'
    `Footprint` and the prompts' token ids; every other engine is shut down and dropped."""
    available = memory.available_memory_bytes()  # before this process holds any model
    target, draft = load_model(config.target), load_model(config.draft)
    footprint = memory.Footprint.of(target.model, draft.model)
    sampling = config.sampling
    prompt_ids = [check_prompt(tokenize_prompt(target.tokenizer, p.text, config.chat), sampling, target.vocab_size,
                               target.max_context) for p in config.prompts]
    # float32: the rows HF's methods are compared with run the same weights (other precisions: their own rows)
    engine_config = EngineConfig(target=config.target, draft=config.draft, num_speculative_tokens="auto",
                                 max_speculative_tokens=config.max_speculative_tokens, num_threads=config.num_threads,
                                 target_precision="float32")
    results.engine["device"] = str(target.device)
    pair = ray_phase.Pair(engine_config)
    # Engines preparing their own copy of the draft: the defaults' (auto precision) and each lever's.
    copies = 1 + sum(p != "none" for p in config.precisions) + len(config.draft_vocabs)
    copies += len(config.target_precisions)  # each with a draft of its own precision
    need = footprint.in_process(copies) + len(config.target_precisions) * footprint.target_linears // 4
    reason = memory.shortfall(need, available)
    if reason:
        results.skip("in-process", reason)
        if config.hopeless:
            results.skip("random-init draft", "it runs on the in-process phase's engines")
        return pair, footprint, prompt_ids
    spec = SpeculativeEngine(engine_config, target, draft)
    results.engine.update(_engine_meta(spec))
    plain = SpeculativeEngine(dataclasses.replace(engine_config, draft="none"), target)
    try:
        _attempt(config, results, "in-process",
                 lambda: _in_process_phase(config, engine_config, target, draft, spec, plain, prompt_ids, results))
        if config.hopeless:
            reason = memory.shortfall(footprint.hopeless(), memory.available_memory_bytes())
            if reason:
                results.skip("random-init draft", reason)
            else:
                _attempt(config, results, "random-init draft",
                         lambda: _hopeless_phase(config, engine_config, target, draft, plain,
                                                 prompt_ids[:config.hopeless], sampling, results))
    finally:
        plain.shutdown()
    if not config.ray_tps:
        spec.shutdown()
        return pair, footprint, prompt_ids
    if spec.linear_kernel == "onednn":  # hybrid and torch still run the original weights
        _drop_mkl_weights(target.model)  # the HF methods are done: room for the Ray actors' copy
    pair.hold(spec)
    return pair, footprint, prompt_ids


def _engine_meta(spec: SpeculativeEngine) -> dict:
    return {"speculative_sampling_default": spec.config.speculative_sampling, "linear_kernel": spec.linear_kernel,
            "draft_precision": spec.draft_precision,
            "draft_calibration": [dataclasses.asdict(m) for m in spec.draft_calibration],
            "calibration": spec.calibration}  # what auto measured for the kernel and the draft, and when


def _in_process_phase(config: BenchConfig, engine_config: EngineConfig, target, draft, spec, plain, prompt_ids,
                      results: Results) -> None:
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
    own = _lever_methods(config, engine_config, target, draft)  # engines of this phase alone
    if config.ngram:
        own.append(Specdec("specdec-ngram", SpeculativeEngine(dataclasses.replace(engine_config, draft="ngram"),
                                                               target), "auto"))
    for precision in config.target_precisions:
        own += _precision_methods(config, engine_config, draft, precision, results)
    methods += own
    try:
        results.measure(methods, prompt_ids, config.sampling, "bench", config.warmup)
    finally:
        for method in own:  # their scheduler threads hold them (and their drafts) until shut down
            method.engine.shutdown()


def _precision_methods(config: BenchConfig, engine_config: EngineConfig, draft, precision: str,
                       results: Results) -> list:
    """Target-only and auto-K rows of the target at `precision`, on a copy of the target loaded for
    them (the HF methods run the float32 one); the auto row is paired with the target-only one."""
    target = load_model(config.target)
    at = dataclasses.replace(engine_config, target_precision=precision)
    plain = Specdec(f"specdec-none ({precision} target)", SpeculativeEngine(
        dataclasses.replace(at, draft="none"), target), None, group="target precision")
    auto = Specdec(f"specdec-auto ({precision} target)", SpeculativeEngine(at, target, draft), "auto",
                   group="target precision")
    results.paired[auto.name] = plain.name
    results.engine.setdefault("target_precisions", {})[precision] = auto.engine.calibration
    return [plain, auto]


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
    results.paired[methods[1].name] = methods[0].name
    try:
        results.measure(methods, prompt_ids, sampling, "bench random-init draft", config.warmup)
    finally:
        hopeless.shutdown()


def _drop_mkl_weights(model) -> None:
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.weight = None
    memory.release()


def _ray_phase(config: BenchConfig, tp: int, placement: str, pair: ray_phase.Pair, footprint: memory.Footprint,
               prompt_ids: list[list[int]], results: Results) -> None:
    """One Ray phase, paired as memory allows (`memory.plan_ray`), or skipped."""
    name = f"ray-tp{tp}-{placement}"
    plan = memory.plan_ray(footprint.ray(tp, placement == "separate"), footprint.pair, pair.held,
                           memory.available_memory_bytes())
    if plan.pairing is None:
        results.skip(name, plan.reason)
        return
    results.ray_pairing[name] = plan.pairing
    measure = ray_phase.interleaved if plan.pairing == "interleaved" else ray_phase.before_after
    _attempt(config, results, name, lambda: measure(config, name, tp, placement, pair, prompt_ids, results))


def _write(config: BenchConfig, results: Results, plots: bool = False) -> tuple[list[dict], dict[str, Path]]:
    """bench.json and bench.md from what was measured so far (and the plots, at the end)."""
    sampling = config.sampling
    baseline = BASELINE if config.hf else REFERENCE
    rows = report.summarize(results.runs, baseline, REFERENCE, results.ks, results.groups, sampling.greedy)
    for row in rows:
        pair = results.paired.get(row["method"])
        if pair:
            mine, theirs = results.runs[row["method"]], results.runs.get(pair, [])
            ratios = [a.tokens_per_second / b.tokens_per_second for a, b in zip(mine, theirs) if a and b]
            row["vs_in_process"] = sorted(ratios)[len(ratios) // 2] if ratios else None
            if sampling.greedy:  # lossless against its own pair (an int4 target's speculation: its target-only)
                row["identical_to_pair"] = sum(a.token_ids == b.token_ids for a, b in zip(mine, theirs) if a and b)
    engine = results.engine
    meta = {
        "target": config.target, "draft": config.draft, "prompts": config.prompts_source,
        "num_prompts": len(config.prompts), "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k,
        "speculative_sampling_default": engine.get("speculative_sampling_default"), "chat": config.chat,
        "baseline": baseline, "device": engine.get("device"), "threads": torch.get_num_threads(),
        "linear_kernel": engine.get("linear_kernel"), "draft_precision": engine.get("draft_precision"),
        "draft_calibration": engine.get("draft_calibration", []), "calibration": engine.get("calibration"),
        "cpu": cpu_info().as_dict(), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(), "seconds": round(time.time() - results.started, 1),
        "command": " ".join(sys.argv),
        "ray_pairing": results.ray_pairing, "skipped": results.skipped, "failed": results.failed,
        "interrupted": results.interrupted,
    }
    per_prompt = {name: [None if r is None else {"tokens": len(r.token_ids), "seconds": round(r.seconds, 4),
                                                 "tokens_per_second": round(r.tokens_per_second, 3)}
                         for r in method_runs] for name, method_runs in results.runs.items()}
    return rows, report.write(config.out_dir, rows, meta, per_prompt, with_plots=plots)
