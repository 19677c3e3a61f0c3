"""specdec: lossless speculative decoding. The Ray-free core.

    from specdec import SpeculativeEngine, SamplingParams
    engine = SpeculativeEngine.from_pretrained(target="...", draft="ngram", num_speculative_tokens=4)
    out = engine.generate(prompt="def fib(n):", sampling=SamplingParams(max_tokens=64))

Importing this package never imports Ray (the distributed engine lives in `actors/`), and imports
torch only when a name that needs it is used: `specdec models list` and `specdec --help` stay fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "EngineConfig": "specdec.config",
    "SamplingParams": "specdec.config",
    "SpeculativeEngine": "specdec.engine",
    "GenerationOutput": "specdec.sequence",
    "StreamChunk": "specdec.sequence",
    "SpeculativeStats": "specdec.stats",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
