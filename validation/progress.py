"""The progress bar of every long command: tqdm on stderr, sized to the terminal, with an ETA.

Drawn only when the stream is a terminal and --quiet is not given, so logs, pipes and test output stay
clean; it only reads counts, so it never changes a result.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import sys

from tqdm import tqdm

# set while a sweep computes its profile's runs (``sweep_runs``): how each run reports its rounds
_SWEEP_RUN: contextvars.ContextVar = contextvars.ContextVar("fedpm_sweep_run", default=None)


@contextlib.contextmanager
def sweep_runs(on_round=None):
    """Within the block the runs computed are a sweep's: their flags are the profile's, not typed by the user
    (validation.dnn warns about none of them), and each reports its rounds to ``on_round(run, round, rounds)``
    (the sweep's bar shows them).  Nested, the outer block's ``on_round`` stays."""
    outer = _SWEEP_RUN.get()
    token = _SWEEP_RUN.set(outer if outer is not None and on_round is None else on_round or (lambda *a: None))
    try:
        yield
    finally:
        _SWEEP_RUN.reset(token)


def in_sweep() -> bool:
    return _SWEEP_RUN.get() is not None


def round_done(run: str, done: int, rounds: int) -> None:
    """A run's round ``done`` of ``rounds`` is written: told to the sweep computing it, if any."""
    listener = _SWEEP_RUN.get()
    if listener is not None:
        listener(run, done, rounds)


class _AboveTheBar(io.TextIOBase):
    """A text stream whose whole lines are written above the bars of ``stream`` (tqdm.write), so that a line
    printed while a bar is drawn does not break it."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            tqdm.write(line, file=self.stream)
        return len(text)

    def flush(self) -> None:
        if self.pending:
            tqdm.write(self.pending, file=self.stream)
            self.pending = ""
        self.stream.flush()


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

    def note(self, text: str) -> None:
        """``text`` beside the bar now (the step in progress: a run's round), until the next update's note."""
        self._bar.set_postfix_str(text, refresh=self.enabled)

    @contextlib.contextmanager
    def lines_above(self):
        """Within the block, what is printed on stdout and stderr goes above the bar, line by line, not into it
        (nothing changes where no bar is drawn)."""
        if not self.enabled:
            yield
            return
        out, err = _AboveTheBar(sys.stdout), _AboveTheBar(sys.stderr)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield
        finally:
            out.flush()
            err.flush()

    def close(self) -> None:
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
