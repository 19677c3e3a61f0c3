"""What CPU this is: its model name and the instruction-set extensions that decide which kernels win.

Kernel and precision choices that win on one CPU lose on another (an Intel Sapphire Rapids with
AVX-512, VNNI, bfloat16 and AMX against an AMD EPYC Zen 1 with AVX2 and FMA only), so every
measured figure names the CPU it came from (`specdec bench`'s JSON and Markdown, the calibration
records) and calibration decisions are cached per CPU.

`ONEDNN_MAX_CPU_ISA` (oneDNN's own cap, e.g. `AVX2`) and `ATEN_CPU_CAPABILITY` (ATen's) are honoured:
with them a Sapphire Rapids box runs, and reports itself, as an AVX2-only one. Reads `/proc/cpuinfo`
only: no torch import.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass

#: The extensions that matter to our kernels, in the order they are reported.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")

#: oneDNN ISA caps (`ONEDNN_MAX_CPU_ISA`, case-insensitive) and the flags each rules out.
_CAPS = {
    "sse41": set(ISA_FLAGS),
    "avx": set(ISA_FLAGS),
    "avx2": {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
    "avx2_vnni": {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
    "avx2_vnni_2": {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
    "avx512_core": {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
    "avx512_core_vnni": {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
    "avx512_core_bf16": {"amx_tile", "amx_bf16", "amx_int8"},
    "avx10_1_512": {"amx_tile", "amx_bf16", "amx_int8"},
}


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "Intel(R) Xeon(R) Platinum 8488C", "AMD EPYC 7571", ...
    flags: tuple[str, ...]  # the ISA_FLAGS this CPU has (after any cap)
    cap: str | None = None  # ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY when set

    @property
    def native_bfloat16(self) -> bool:
        """bfloat16 matrix instructions (AVX512-BF16 or AMX): without them bfloat16 is emulated and slow."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def isa(self) -> str:
        """The widest vector ISA: amx, avx512, avx2 or baseline."""
        if "amx_tile" in self.flags:
            return "amx"
        if "avx512f" in self.flags:
            return "avx512"
        return "avx2" if "avx2" in self.flags else "baseline"

    @property
    def key(self) -> str:
        """A short stable id of (model, flags) for cache keys."""
        return hashlib.sha256(f"{self.model}|{','.join(self.flags)}".encode()).hexdigest()[:12]

    def describe(self) -> str:
        """`Intel(R) Xeon(R) Processor (avx2 fma avx512f ... amx_bf16)`, the line every figure carries."""
        capped = f", capped at {self.cap}" if self.cap else ""
        return f"{self.model} ({' '.join(self.flags) or 'no AVX2'}{capped})"

    def as_dict(self) -> dict:
        return {"model": self.model, "isa": self.isa, "flags": list(self.flags), "cap": self.cap,
                "native_bfloat16": self.native_bfloat16, "cores": os.cpu_count()}


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().lower() or None
    aten_cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() or None
    for cap in (onednn_cap, aten_cap):
        if cap in _CAPS:
            flags -= _CAPS[cap]
        elif cap == "default":
            flags -= _CAPS["avx"]
    cap = onednn_cap or aten_cap
    return CpuInfo(model, tuple(f for f in ISA_FLAGS if f in flags), cap)
