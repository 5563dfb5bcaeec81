"""The progress bar of every long command: tqdm on stderr, sized to the terminal, with an ETA.

Drawn only when the stream is a terminal and --quiet is not given, so logs, pipes and test output stay
clean; it only reads counts, so it never changes a result.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """``bar = Progress(total, label, enabled=not args.quiet)``; ``bar.update(n, note)`` after each step.

    ``stream``: where the bar goes (default stderr); it is drawn only if the stream is a terminal."""

    def __init__(self, total: int, label: str = "", stream=None, enabled: bool = True, unit: str = "it"):
        self.stream = sys.stderr if stream is None else stream
        self.total, self._done = max(int(total), 1), 0
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.enabled = bool(enabled and tty)
        self._bar = tqdm(
            total=self.total,
            desc=label or None,
            file=self.stream,
            disable=not self.enabled,
            dynamic_ncols=True,  # follows the terminal's width, also when it is resized
            unit=unit,
            leave=True,
        )

    @property
    def done(self) -> int:
        return self._done

    @done.setter
    def done(self, value: int) -> None:
        """Steps already done before this process (a resumed run): counted, not timed."""
        self._done = self._bar.n = self._bar.last_print_n = min(self.total, int(value))

    def update(self, n: int = 1, note: str = "") -> None:
        n = min(n, self.total - self._done)
        self._done += n
        if note:
            self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(n)
        if self._done == self.total:
            self.close()

    def close(self) -> None:
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
