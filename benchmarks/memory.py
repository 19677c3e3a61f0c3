"""Memory between the phases of `specdec bench`: what a phase needs, whether this machine has it, and
handing back what a finished phase held.

A bench run loads the models more than once: the in-process methods share one target and draft;
each Ray phase loads them again in its actors; the hopeless phase adds a random-init draft. The
default pair (the 1.5B target and the 0.5B draft, float32) fits a 24 GB machine once with room to
spare, not twice: the bench process still held 9.45 GB of the in-process methods when a Ray target
shard loaded 12.6 GB, and Ray's memory monitor killed the shard at 95% of memory. So the runner

- calls `release()` after each phase: collect the garbage, then hand the freed heap back to the OS
  (glibc keeps freed pages in its arenas, where another process cannot use them; `malloc_trim(0)`
  returns them, as PyTorch users do between models);
- estimates each phase from a `Footprint` taken when the models load (the bytes of their
  parameters as loaded: float32 on the CPU) and compares it with MemAvailable (`/proc/meminfo`),
  keeping `HEADROOM` spare, before starting the phase (`shortfall`, `plan_ray`);
- after stopping a Ray engine, waits for the memory its actors held to come back (`settle`):
  `ray.kill` returns before the processes are gone.

The estimates count weights and a fixed allowance per process, not activations or KV caches (small
beside the weights at the bench's lengths); they are meant to refuse a phase that would surely not
fit, not to predict its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from dataclasses import dataclass

import torch

from specdec.kernels.linear import available_memory_bytes, linear_weight_bytes

#: Spare memory a phase must leave: activations and caches, and Ray's memory monitor, which kills
#: workers once the node is 95% full (1.2 GB of a 24 GB machine).
HEADROOM = 1 << 30
#: One Ray process beside its weights: Python, torch, transformers, Ray's core worker (a process
#: that imported torch, transformers and ray measured 285 MB resident before loading anything).
PROCESS_BYTES = 512 << 20


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s parameters as loaded (shared tensors, e.g. tied embeddings, once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass(frozen=True)
class Footprint:
    """The models' sizes, taken once as they load (before any kernel prepacks them)."""

    target: int  # bytes of the target's parameters
    target_linears: int  # of its linear weights: what prepacking them for oneDNN copies
    draft: int  # bytes of the draft's parameters

    @classmethod
    def of(cls, target: torch.nn.Module, draft: torch.nn.Module) -> "Footprint":
        return cls(parameter_bytes(target), linear_weight_bytes(target), parameter_bytes(draft))

    @property
    def pair(self) -> int:
        """The in-process engine a Ray phase is paired with: the target and the draft."""
        return self.target + self.draft

    def in_process(self, draft_copies: int) -> int:
        """The in-process methods: the target with its linears twice (HF runs the loaded weights,
        specdec a prepacked copy, both in use), the draft (HF's assistant), and `draft_copies`
        engines that prepare a copy of the draft each, at a lower precision (bfloat16: half its
        size; int8 less)."""
        return self.target + self.target_linears + self.draft + draft_copies * self.draft // 2

    def hopeless(self) -> int:
        """A random-init draft of the draft's shape, and the copy its engine prepares."""
        return 2 * self.draft

    def ray(self, tp: int, separate: bool) -> int:
        """A Ray phase: the target over `tp` shards (at tp=1 the shard prepacks its linears for
        oneDNN beside the loaded weights), the draft, and `PROCESS_BYTES` for each shard, the
        coordinator and a separate draft worker."""
        prepacked = self.target_linears if tp == 1 else 0
        return self.target + prepacked + self.draft + (tp + 1 + int(separate)) * PROCESS_BYTES


def gigabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.1f} GB"


def shortfall(need: int, available: int | None) -> str | None:
    """Why a phase needing `need` bytes cannot start with `available` bytes free (None: it fits, or
    the OS does not say how much is free)."""
    if available is None or need + HEADROOM <= available:
        return None
    return f"needs ~{gigabytes(need)} (+{gigabytes(HEADROOM)} spare), {gigabytes(available)} available"


@dataclass(frozen=True)
class RayPlan:
    """How a Ray phase meets its in-process pair: "interleaved" (both held, prompt by prompt),
    "before/after" (one at a time), or None: skipped, for `reason`."""

    pairing: str | None
    reason: str = ""


def plan_ray(need: int, pair: int, pair_held: bool, available: int | None) -> RayPlan:
    """Both at once when they fit; else the pair released while the Ray phase runs (this process
    gives back `pair` bytes if it holds them); else neither."""
    if available is None:
        return RayPlan("interleaved")
    room = available + (pair if pair_held else 0)
    if shortfall(need + pair, room) is None:
        return RayPlan("interleaved")
    reason = shortfall(max(need, pair), room)
    if reason is None:
        return RayPlan("before/after")
    return RayPlan(None, reason + (" with the in-process engine released" if pair_held else ""))


def settle(timeout_s: float = 30.0, poll_s: float = 0.5) -> None:
    """Wait until the free memory stops rising (two polls in a row), at most `timeout_s`."""
    last, steady, deadline = available_memory_bytes(), 0, time.monotonic() + timeout_s
    while last is not None and steady < 2 and time.monotonic() < deadline:
        time.sleep(poll_s)
        now = available_memory_bytes()
        if now is None:
            return
        steady = steady + 1 if now - last < _RISING else 0
        last = now


_RISING = 64 << 20  # more than this back per poll: processes are still exiting


def release() -> None:
    """Free what nothing references any more and hand the freed heap back to the OS (glibc only;
    elsewhere collecting is all there is to do)."""
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): no such function
        return None


_malloc_trim = _find_malloc_trim()
