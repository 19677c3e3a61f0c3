"""Start-up stages, timed and announced: where the seconds before the first token go.

Each stage of building an engine (load target, prepare target, load draft, prepare draft, warm-up)
runs inside `stage(...)`, which logs one line when it ends on the `specdec.startup` logger (the CLI
shows it on stderr) and adds its seconds to the `recording()` open in this thread, if any: the
engine keeps them as `SpeculativeEngine.startup_seconds`, a Ray target shard reports them, and
`specdec serve` prints them with its ready line.

    with recording() as seconds:
        with stage("load target", "qwen2.5-coder-1.5b-instruct"):
            ...
    seconds  # {"load target": 2.4}
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger("specdec.startup")
_recordings: contextvars.ContextVar[tuple[dict[str, float], ...]] = contextvars.ContextVar("recordings", default=())


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Collect the seconds of every stage run inside the block (nested: the outer one too), in this
    thread and in the threads it starts with `in_background`."""
    seconds: dict[str, float] = {}
    token = _recordings.set((*_recordings.get(), seconds))
    try:
        yield seconds
    finally:
        _recordings.reset(token)


class in_background:  # noqa: N801 - used like a function
    """Run `fn(*args)` in a thread (its stages recorded as the caller's); `join()` returns its result
    or raises its exception."""

    def __init__(self, fn: Callable, *args) -> None:
        self._result, self._error = None, None
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run, fn, *args), name="specdec-startup",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, *args) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self._error = e

    def join(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class _Note:
    """What a stage found out while it ran (`note.detail = ...`), logged with its time."""

    def __init__(self, detail: str) -> None:
        self.detail = detail


@contextlib.contextmanager
def stage(name: str, detail: str = "") -> Iterator[_Note]:
    """Time one start-up stage; log `name (detail): N.Ns` when it ends (not when it fails). The block
    may replace the detail with what it decided (`with stage("choose target kernel") as note:`)."""
    start = time.perf_counter()
    note = _Note(detail)
    yield note
    seconds = time.perf_counter() - start
    for record in _recordings.get():
        record[name] = record.get(name, 0.0) + seconds
    logger.info("%s%s: %.1fs", name, f" ({note.detail})" if note.detail else "", seconds)


def summary(seconds: dict[str, float]) -> str:
    """`load target 2.4s, prepare target 2.9s, ...` in the order the stages ran."""
    return ", ".join(f"{name} {s:.1f}s" for name, s in seconds.items())
