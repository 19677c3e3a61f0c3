"""The Ray phases of `specdec bench` and their in-process pair.

A Ray phase (per tensor-parallel size and draft placement: `ray-tp1-colocated`, ...) runs the Ray
engine with the draft colocated in the rank-0 shard, or in its own actor with pipelining off and
on. Each is paired with the in-process engine at the same settings (`specdec-auto`, the defaults)
and reported as the ratio of the two on the same prompts (`vs_in_process`): the Ray path's overhead.

What the pair needs is one engine: the target (on oneDNN it drops the MKL originals once the HF
methods are done; tp=1 shards run oneDNN too) and the draft at the precision it chose; every other
phase-1 engine is gone by now. The Ray phase loads the target and draft again, in its actors.
Holding both lets the pair run prompt by prompt between the Ray methods, the fairest comparison
(both see the same machine state, drift cancels prompt by prompt), so a phase does that whenever
both fit (`ray_pairing` "interleaved"). When only one fits at a time (the default pair on a 24 GB
machine, estimated: ~8 GB here beside ~16 GB for a tp=1 phase; the run that Ray's memory monitor
killed at 95%), the pair runs every prompt just before the Ray engine starts, is released, and is
reloaded at the kernel and draft precision it had chosen to run every prompt again just after the
Ray engine stops. Its time on a prompt is the mean of the two (`ray_pairing` "before/after": drift
that is linear over the phase cancels, faster noise does not), and the Ray methods still interleave
among themselves. Comparing with phase 1's `specdec-auto` row instead would compare machine states
many minutes apart. Which pairing a phase can afford, if any, is `memory.plan_ray`'s decision.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from benchmarks import memory
from benchmarks.methods import Run, Specdec
from specdec import EngineConfig, SpeculativeEngine
from specdec.models.loading import load_model

if TYPE_CHECKING:
    from benchmarks.runner import BenchConfig, Results


class Pair:
    """The in-process engine each Ray phase is compared with: phase 1's `specdec-auto` engine while
    it is held; once released, reloaded at the linear kernel and draft precision that engine chose
    (the same settings, without measuring them again)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine: SpeculativeEngine | None = None

    @property
    def held(self) -> bool:
        return self.engine is not None

    def hold(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self.config = dataclasses.replace(self.config, linear_kernel=engine.linear_kernel,
                                          draft_precision=engine.draft_precision)

    def get(self) -> SpeculativeEngine:
        if self.engine is None:
            self.hold(SpeculativeEngine(self.config, load_model(self.config.target), load_model(self.config.draft)))
        return self.engine

    def release(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()  # its scheduler thread holds it (and the models) until then
            self.engine = None
        memory.release()


def interleaved(config: BenchConfig, name: str, tp: int, placement: str, pair: Pair, prompt_ids: list[list[int]],
                results: Results) -> None:
    """The Ray methods and the pair, prompt by prompt."""
    pair_method = Specdec(f"specdec-auto (pair of {name})", pair.get(), "auto")
    ray_engine = _start(config, tp, placement, pair)
    try:
        methods = [pair_method] + _methods(name, placement, ray_engine, pair_method.name, results)
        results.measure(methods, prompt_ids, config.sampling, f"bench {name}", config.warmup)
    finally:
        _stop(ray_engine)


def before_after(config: BenchConfig, name: str, tp: int, placement: str, pair: Pair,
                 prompt_ids: list[list[int]], results: Results) -> None:
    """The pair on every prompt, released; the Ray methods prompt by prompt; the pair reloaded, on
    every prompt again. The pair's run of a prompt takes the mean of its two times. A Ray failure
    is raised after the second block, so the rows it measured before still have their pair."""
    pair_name, after_name = f"specdec-auto (pair of {name})", f"specdec-auto (pair of {name}, after)"
    _pair_block(config, pair, pair_name, prompt_ids, results, f"bench {name}: pair before")
    pair.release()
    methods: list[Specdec] = []
    failure = None
    try:
        ray_engine = _start(config, tp, placement, pair)
        try:
            methods = _methods(name, placement, ray_engine, pair_name, results)
            results.measure(methods, prompt_ids, config.sampling, f"bench {name}", config.warmup)
        finally:
            _stop(ray_engine)
    except Exception as e:  # noqa: BLE001 - re-raised below
        failure = e
    measured = any(results.runs.get(m.name) for m in methods)
    if measured:
        _pair_block(config, pair, after_name, prompt_ids, results, f"bench {name}: pair after")
        results.runs[pair_name] = [_mean_run(b, a) for b, a in zip(results.runs[pair_name], results.runs[after_name])]
    for table in (results.runs, results.ks, results.groups):
        table.pop(after_name, None)
        if not measured:  # nothing to compare the pair with
            table.pop(pair_name, None)
    if failure is not None:
        raise failure


def _start(config: BenchConfig, tp: int, placement: str, pair: Pair):
    """The Ray engine at its pair's settings (target precision, linear kernel, draft precision), so
    its rows compare the same model computed the same way; tensor-parallel shards choose their
    kernel for their own slice of the weights."""
    from actors import RayEngineConfig, RolePlacement, build_ray_engine

    threads = config.num_threads or torch.get_num_threads()
    engine_config = dataclasses.replace(pair.config, linear_kernel=pair.config.linear_kernel if tp == 1 else "auto")
    return build_ray_engine(RayEngineConfig(
        engine=engine_config, tp=tp, draft_placement=placement,
        draft_role=RolePlacement(num_threads=threads),
        target_role=RolePlacement(num_threads=max(1, threads // tp))))


def _stop(ray_engine) -> None:
    """Stop the Ray engine and wait for its actors' memory: the next load here, or the next
    phase's estimate, must see it free."""
    ray_engine.shutdown()
    memory.settle()


def _methods(name: str, placement: str, ray_engine, pair_name: str, results: Results) -> list[Specdec]:
    methods = [Specdec(name, ray_engine, "auto", group="ray", pipeline=False)]
    if placement == "separate":
        methods.append(Specdec(f"{name}-pipeline", ray_engine, "auto", group="ray", pipeline=True))
    for m in methods:
        results.paired[m.name] = pair_name
    return methods


def _pair_block(config: BenchConfig, pair: Pair, name: str, prompt_ids, results: Results, desc: str) -> None:
    results.measure([Specdec(name, pair.get(), "auto")], prompt_ids, config.sampling, desc, config.warmup)


def _mean_run(before: Run | None, after: Run | None) -> Run | None:
    """One prompt's pair run: the first block's tokens and statistics, the mean of the two times."""
    if before is None or after is None:
        return before or after
    return Run(before.token_ids, (before.seconds + after.seconds) / 2, before.stats)
