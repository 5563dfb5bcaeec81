"""Output folders that never destroy data.

A folder written by these commands holds a marker file (``.fedpm-result``).  An ``--out`` that
already exists is replaced only when it carries that marker (a previous result of ours) or is
empty; any other folder, or a file, is refused with one line and left untouched.

Results are written into a hidden sibling ``.partial-<pid>-*`` and moved into place only when
complete; the previous result is moved aside (``.old-<pid>-*``) and removed only after the new
one is in place.  The temporary folders are removed on every exit path Python sees (an error,
Ctrl-C, SIGTERM); after a kill -9 the next run in the same parent folder removes those whose
process no longer exists.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading

MARKER = ".fedpm-result"
_TEMP = re.compile(r"^\.(partial|old)-(\d+)-")


class OutputError(ValueError):
    """--out cannot receive results without destroying something; the message names it."""


# what our commands write; a folder holding only these (and a summary) is a result written
# before the marker existed
_OUR_FILES = {"history.csv", "summary.json", "convergence.png", "convergence.pdf", "result.json", "checkpoint.pt"}


def is_ours(path: str) -> bool:
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = set(os.listdir(path))
    if MARKER in names:
        return True
    return bool(names) and names <= _OUR_FILES and bool(names & {"summary.json", "result.json"})


def check_out(path: str, flag: str = "--out") -> None:
    """Raise OutputError unless ``path`` may receive our results (absent, empty, or a previous result)."""
    if not path or not str(path).strip():
        raise OutputError(f"{flag}: empty path")
    if os.path.islink(path):
        raise OutputError(f"{flag} {path}: is a symbolic link; give the real folder")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise OutputError(f"{flag} {path}: exists and is not a folder; choose another {flag}")
    if os.path.isdir(path) and os.listdir(path) and not is_ours(path):
        raise OutputError(
            f"{flag} {path}: folder exists and is not a previous result of this tool (no {MARKER}); "
            f"choose another {flag} or empty it"
        )
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OutputError(f"{flag} {path}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: {probe} is not writable")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(parent: str) -> None:
    """Remove temporary folders of ours left by processes that no longer exist (kill -9)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = _TEMP.match(name)
        if m and int(m.group(2)) != os.getpid() and not _alive(int(m.group(2))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def mark(folder: str) -> None:
    with open(os.path.join(folder, MARKER), "w") as fh:
        fh.write("written by the FedPM toolkit; this folder may be replaced by a later run\n")


@contextlib.contextmanager
def sigterm_as_exit():
    """Within the block SIGTERM raises SystemExit(143), so cleanup code runs (main thread only).  A handler
    already installed stays (``common.run_command``'s raises ``Terminated``, cleaned up the same way and then
    reported in one line)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class ResultDir:
    """``with ResultDir(out) as tmp:`` write into ``tmp``; on success it becomes ``out``.

    The previous result (if any) survives until the new one is complete; on any exception
    (KeyboardInterrupt and SystemExit included) ``tmp`` is removed and ``out`` is as before."""

    def __init__(self, path: str, flag: str = "--out", marked: bool = True):
        """``marked``: the folder carries MARKER (a later run may replace it); False for a folder that must
        never be replaced (its callers refuse an existing one)."""
        self.path = os.path.abspath(path)
        self.flag = flag
        self.shown = path
        self.marked = marked
        check_out(path, flag)

    def __enter__(self) -> str:
        self._term = sigterm_as_exit()
        self._term.__enter__()
        try:
            parent = os.path.dirname(self.path)
            os.makedirs(parent, exist_ok=True)
            clean_stale(parent)
            self.tmp = tempfile.mkdtemp(prefix=f".partial-{os.getpid()}-", dir=parent)
            if self.marked:
                mark(self.tmp)
        except BaseException:
            self._term.__exit__(None, None, None)
            raise
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            try:
                self.commit()
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
            return False
        finally:
            self._term.__exit__(None, None, None)

    def commit(self) -> None:
        check_out(self.shown, self.flag)  # it may have changed while we computed
        old = None
        if os.path.lexists(self.path):
            old = tempfile.mkdtemp(prefix=f".old-{os.getpid()}-", dir=os.path.dirname(self.path))
            aside = os.path.join(old, "previous")
            os.rename(self.path, aside)
            try:
                os.rename(self.tmp, self.path)
            except BaseException:
                os.rename(aside, self.path)
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.tmp, self.path)
