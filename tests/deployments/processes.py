"""Helpers for tests that start servers: a free local port, a line from a child's output with a bound."""

from __future__ import annotations

import queue
import socket
import threading


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(stream, timeout_s: float) -> str | None:
    """The next line of `stream`, or None if none comes within `timeout_s` (a child that hangs)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return None
