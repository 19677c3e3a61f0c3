"""specdec: lossless speculative decoding. The Ray-free core.

    from specdec import SpeculativeEngine, SamplingParams
    engine = SpeculativeEngine.from_pretrained(target="...", draft="ngram", num_speculative_tokens=4)
    out = engine.generate(prompt="def fib(n):", sampling=SamplingParams(max_tokens=64))

Importing this package never imports Ray (the distributed engine lives in `actors/`).
"""

__version__ = "0.1.0"

from specdec.config import EngineConfig, SamplingParams  # noqa: E402
from specdec.engine import SpeculativeEngine  # noqa: E402
from specdec.sequence import GenerationOutput, StreamChunk  # noqa: E402
from specdec.stats import SpeculativeStats  # noqa: E402

__all__ = [
    "EngineConfig",
    "GenerationOutput",
    "SamplingParams",
    "SpeculativeEngine",
    "SpeculativeStats",
    "StreamChunk",
    "__version__",
]
