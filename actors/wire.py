"""What crosses Ray per call: calls, bytes received and bytes returned, counted per actor method.

Off unless asked (`enable`): measuring pickles each call's arguments and result once more. Tests
and benchmarks turn it on to show what a step costs on the wire (`tests/actors/test_lean_step.py`):
Ray serializes with pickle protocol 5 (tensors out of band), so the pickled size is what travels.
"""

from __future__ import annotations

import pickle
from collections import Counter


class WireLog:
    def __init__(self) -> None:
        self.enabled = False
        self.calls: Counter[str] = Counter()
        self.received: Counter[str] = Counter()  # bytes of the arguments
        self.returned: Counter[str] = Counter()  # bytes of the result

    def record(self, method: str, args, result):
        """Count one call of `method` (when enabled); returns `result`."""
        if self.enabled:
            self.calls[method] += 1
            self.received[method] += _size(args)
            self.returned[method] += _size(result)
        return result

    def enable(self, on: bool = True) -> dict:
        """Turn counting on (from zero) or off; what was counted so far."""
        counted = self.snapshot()
        self.enabled = on
        self.calls.clear(), self.received.clear(), self.returned.clear()
        return counted

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "received": dict(self.received), "returned": dict(self.returned)}


def _size(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))
