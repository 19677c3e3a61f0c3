"""Forward progress: how far a model has got inside a forward, readable while the forward runs.

A health check that waits for whole calls to finish cannot tell a slow forward (a big model on a
busy CPU, a long prompt's prefill chunk, a first kernel build) from one that will never finish.
Every decoder layer bumps a counter as it finishes (a forward hook: an int increment and a clock
read, a microsecond or two against a layer's milliseconds), so "no layer finished for N seconds"
means stuck, and anything less means slow. `actors/` reads `snapshot()` from another thread of the
actor (a Ray concurrency group) while the forward runs.

Test hooks, read from the environment here and nowhere else (`specdec.config.env`), or set on the
object: SPECDEC_TEST_LAYER_DELAY_S sleeps that long after every decoder layer (a slow CPU);
SPECDEC_TEST_WEDGE_FORWARD=N blocks forever, without progress, in the first layer of this process's
Nth model call (`running`; N=2 is the first forward after a lone request's prefill).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specdec.config import env

logger = logging.getLogger(__name__)


def progress_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose completion counts as progress: the decoder layers (`*DecoderLayer` in every
    transformers family we load), else every leaf linear module (`nn.Linear`, or a replacement such
    as `specdec.kernels.linear.PackedLinear` or a quantized linear)."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if layers:
        return layers
    return [m for m in model.modules()
            if not next(m.children(), None) and (isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Linear"))]


class ForwardProgress:
    """One process's progress: decoder layers finished and model calls begun, and when the last
    of either happened. Written by the thread that runs the model, read by any other."""

    def __init__(self, layer_delay_s: float = 0.0, wedge_forward: int = 0) -> None:
        self.num_layers = 0  # decoder layers finished since the process started
        self.num_calls = 0  # model calls begun (`running`)
        self.call: str | None = None  # the call running now ("forward", "propose"), None when idle
        self.call_started = 0.0  # time.monotonic() when it began
        self.last_progress = time.monotonic()  # a layer finished, or a call began or ended
        self.layer_delay_s = layer_delay_s  # test hook: sleep after every layer
        self.wedge_forward = wedge_forward  # test hook: the call (1-based) that blocks forever; 0: none
        self._hooked: set[int] = set()
        self._never = threading.Event()  # what a wedged layer waits on

    @classmethod
    def from_env(cls) -> ForwardProgress:
        """With the test hooks of the environment (see the module docstring); none by default."""
        delay, wedge = env("TEST_LAYER_DELAY_S"), env("TEST_WEDGE_FORWARD")
        progress = cls(float(delay) if delay else 0.0, int(wedge) if wedge else 0)
        if progress.layer_delay_s or progress.wedge_forward:
            logger.warning("test hooks on: %.2fs delay per layer, wedge call %d", progress.layer_delay_s,
                           progress.wedge_forward)
        return progress

    def watch(self, model: torch.nn.Module) -> int:
        """Count `model`'s layers (`progress_modules`) from now on; the number of modules watched."""
        modules = [m for m in progress_modules(model) if id(m) not in self._hooked]
        for module in modules:
            module.register_forward_hook(self._layer_done)
            self._hooked.add(id(module))
        return len(modules)

    @contextmanager
    def running(self, call: str) -> Iterator[None]:
        """Mark a model call (beginning and ending one is progress too: an idle process is not stuck)."""
        self.num_calls += 1
        self.call, self.call_started = call, time.monotonic()
        self.last_progress = self.call_started
        try:
            yield
        finally:
            self.call = None
            self.last_progress = time.monotonic()

    def snapshot(self) -> dict:
        """What a health check needs: counters, the running call and for how long, and the seconds
        since the last progress (`quiet_s`)."""
        now = time.monotonic()
        call, started = self.call, self.call_started
        return {"num_layers": self.num_layers, "num_calls": self.num_calls, "call": call,
                "call_s": now - started if call is not None else None, "quiet_s": now - self.last_progress}

    def _layer_done(self, module, args, output) -> None:
        self.num_layers += 1
        self.last_progress = time.monotonic()
        if self.layer_delay_s:
            time.sleep(self.layer_delay_s)
        if self.wedge_forward and self.num_calls >= self.wedge_forward:
            logger.warning("test hook: model call %d wedged in a layer", self.num_calls)
            self._never.wait()
