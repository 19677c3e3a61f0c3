"""The decoding methods a benchmark compares. Each runs one prompt and returns its tokens, its
wall-clock time and, for specdec methods, the speculation statistics.

Every method is timed the same way, around one whole call (prefill included), on the same
token ids; Hugging Face methods run on stock kernels (`stock_linears`) even when they share the
target's weights with a specdec engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.kernels.linear import stock_linears
from specdec.decoding.stats import SpeculativeStats


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    stats: SpeculativeStats | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


class HFGenerate:
    """`model.generate()` as users already run it: target-only, assisted, or prompt lookup."""

    def __init__(self, name: str, model, eos_token_ids, group: str = "hf", **generate_kwargs) -> None:
        self.name, self.group, self.k = name, group, None
        self.model = model
        self.eos_token_ids = sorted(eos_token_ids)
        self.generate_kwargs = generate_kwargs

    def run(self, prompt_token_ids: list[int], sampling: SamplingParams) -> Run:
        kwargs = dict(max_new_tokens=sampling.max_tokens, eos_token_id=self.eos_token_ids or None,
                      pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else None)
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k or None)
            torch.manual_seed(sampling.seed if sampling.seed is not None else 0)
        with torch.inference_mode(), stock_linears(self.model):
            start = time.perf_counter()
            out = self.model.generate(torch.tensor([prompt_token_ids]), **kwargs, **self.generate_kwargs)
            seconds = time.perf_counter() - start
        return Run(out[0, len(prompt_token_ids):].tolist(), seconds)


class Specdec:
    """A specdec engine (in-process `SpeculativeEngine` or Ray `RayEngine`) at a given K."""

    def __init__(self, name: str, engine, k: int | str | None, group: str = "specdec",
                 pipeline: bool | None = None, sampling_mode: str | None = None) -> None:
        self.name, self.group, self.k = name, group, k
        self.engine = engine
        self.pipeline = pipeline
        self.sampling_mode = sampling_mode  # invariant | residual (None: the engine's default)

    def run(self, prompt_token_ids: list[int], sampling: SamplingParams) -> Run:
        kwargs = {"num_speculative_tokens": self.k} if self.k is not None else {}
        if self.pipeline is not None:
            kwargs["pipeline"] = self.pipeline
        if self.sampling_mode is not None:
            sampling = sampling.replace(speculative_sampling=self.sampling_mode)
        start = time.perf_counter()
        out = self.engine.generate(prompt_token_ids=prompt_token_ids, sampling=sampling, **kwargs)
        seconds = time.perf_counter() - start
        return Run(out.token_ids, seconds, out.speculative)
