"""specdec: lossless speculative decoding. The Ray-free core.

    from specdec import SpeculativeEngine, SamplingParams
    engine = SpeculativeEngine.from_pretrained(target="...", draft="ngram", num_speculative_tokens=4)
    out = engine.generate(prompt="def fib(n):", sampling=SamplingParams(max_tokens=64))

Importing this package never imports Ray (the distributed engine lives in `actors/`), and imports
torch only when a name that needs it is used: `specdec models list` and `specdec --help` stay fast.

Subpackages, in the order a token passes through them:
- `specdec.decoding`: the algorithm. Proposers (the draft), verification, sampling, logits processing,
  structured output, how many tokens to propose, statistics.
- `specdec.engine`: requests and the batch scheduler that runs the algorithm over many of them, the
  in-process engine and the backend seams the Ray actors plug into, prompts in and text out.
- `specdec.models`: presets and the converted-weights cache, loading, KV caches and batched forwards.
- `specdec.kernels`: the CPU's features, linear kernels, draft precision and load-time calibration.
`specdec.config` (every option) and `specdec.cli` (the `specdec` command) sit at the top.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "EngineConfig": "specdec.config",
    "SamplingParams": "specdec.config",
    "SpeculativeEngine": "specdec.engine.local",
    "GenerationOutput": "specdec.engine.request_state",
    "StreamChunk": "specdec.engine.request_state",
    "SpeculativeStats": "specdec.decoding.stats",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
