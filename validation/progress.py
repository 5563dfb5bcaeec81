"""A dependency-free progress bar on stderr (redrawn in place on a terminal, sparse lines otherwise)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", stream=None, enabled: bool = True):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_pct = -1

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        pct = int(100 * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note}"
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
            if self.done == self.total:
                self.stream.write("\n")
        elif pct // 25 != self._last_pct // 25 or self.done == self.total or note:
            self.stream.write(line + "\n")
        self._last_pct = pct
        self.stream.flush()
