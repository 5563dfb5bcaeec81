"""Output folders that never destroy data.

A folder written by these commands holds a marker file (``.fedpm-result``) naming the command that wrote it.
An ``--out`` that already exists is taken only when it is empty, or when it carries the marker of the same
command and holds nothing but files that command writes (``Kind``): a folder without the marker, one of another
command (a DNN run's checkpoint given to the convex experiment) or one holding any other file is refused with one
line naming what is in the way, and left untouched.  Two runs never write into one ``--out`` at once: each holds
an exclusive lock (``exclusive``) while it writes, and the second is refused.

Results are written into a hidden sibling ``.partial-<pid>-*`` and moved into place only when
complete; the previous result is moved aside (``.old-<pid>-*``) and removed only after the new
one is in place.  The temporary folders are removed on every exit path Python sees (an error,
Ctrl-C, SIGTERM); after a kill -9 the next run in the same parent folder removes those whose
process no longer exists, and the lock file nobody holds.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # no advisory locks on this platform: runs are not serialised there
    fcntl = None

MARKER = ".fedpm-result"
_TEMP = re.compile(r"^\.(partial|old)-(\d+)-")
_LOCK = re.compile(r"^\..+\.fedpm-lock$")


class OutputError(ValueError):
    """--out cannot receive results without destroying something; the message names it."""


@dataclass(frozen=True)
class Kind:
    """A command's results: its name (recorded in the marker) and the file names (shell patterns) it writes into
    its folder; the per-process temporary files of an atomic write beside them (``<name>.<pid>.tmp``) are its own
    too, whatever a kill -9 left."""

    command: str
    files: tuple

    def owns(self, name: str) -> bool:
        base = re.sub(r"(\.\d+)?\.tmp$", "", name)
        return any(fnmatch.fnmatchcase(n, pat) for n in {name, base} for pat in self.files)


def written_by(path: str) -> str | None:
    """The command named in ``path``'s marker; '' for a marker of an earlier version (which names none); None when
    there is no marker."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker, "rb") as fh:
            info = json.loads(fh.read(4096))
        return str(info.get("written_by", "")) if isinstance(info, dict) else ""
    except (OSError, ValueError):
        return ""


def _in_the_way(path: str, flag: str, kind: Kind | None) -> str | None:
    """Why the existing, non-empty folder ``path`` may not receive ``kind``'s results, or None."""
    names = sorted(n for n in os.listdir(path) if n != MARKER)
    writer = written_by(path)
    if writer is None:
        shown = names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
        return (
            f"{flag} {path}: is not a previous result of this tool: it holds {shown} and no {MARKER}; "
            f"choose another {flag} or move them away"
        )
    if kind is None:
        return None
    if writer and writer != kind.command:
        return f"{flag} {path}: holds a result of {writer}, not of {kind.command}; choose another {flag}"
    foreign = [n for n in names if not kind.owns(n)]
    if foreign:
        return (
            f"{flag} {path}: holds {foreign[0]}, which {kind.command} does not write; "
            f"choose another {flag} or move it away"
        )
    return None


def check_out(path: str, flag: str = "--out", kind: Kind | None = None) -> None:
    """Raise OutputError unless ``path`` may receive ``kind``'s results: absent, empty, or a previous result of the
    same command holding only its own files (``kind`` None: any folder of ours)."""
    if not path or not str(path).strip():
        raise OutputError(f"{flag}: empty path")
    if os.path.islink(path):
        raise OutputError(f"{flag} {path}: is a symbolic link; give the real folder")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise OutputError(f"{flag} {path}: exists and is not a folder; choose another {flag}")
    if os.path.isdir(path) and os.listdir(path):
        why = _in_the_way(path, flag, kind)
        if why:
            raise OutputError(why)
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OutputError(f"{flag} {path}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: {probe} is not writable")


def _lock_path(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.fedpm-lock")


_HELD: dict = {}  # lock path -> how many blocks of this process hold it (a command's run, then its ResultDir)


@contextlib.contextmanager
def exclusive(path: str, flag: str = "--out"):
    """Within the block this process alone writes ``path``: a second run asking for the same folder is refused
    with OutputError naming the process that holds it.  The lock (``flock`` on a hidden file beside ``path``) ends
    with the process however it ends; the file is removed on exit, or by the next run after a kill -9.  A block
    within one of the same process that holds it already just goes on."""
    lock = _lock_path(path)
    if fcntl is None or _HELD.get(lock, (None, 0))[0] == os.getpid():
        if fcntl is not None:
            _HELD[lock] = (os.getpid(), _HELD[lock][1] + 1)
        try:
            yield
        finally:
            if fcntl is not None:
                _HELD[lock] = (os.getpid(), _HELD[lock][1] - 1)
        return
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"{flag} {path}: another run (pid {holder}) is writing into it; wait for it to end or choose "
                f"another {flag}"
            ) from None
        try:  # its previous holder may have removed the file between our open and our lock: take the new one
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _HELD[lock] = (os.getpid(), 1)
        yield
    finally:
        _HELD.pop(lock, None)
        with contextlib.suppress(OSError):
            os.remove(lock)
        os.close(fd)


def _remove_unheld_lock(path: str) -> None:
    """A lock file that no process holds (its run was killed with -9) is removed, as ``exclusive`` would."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.remove(path)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        elif fcntl is not None and _LOCK.match(name):
            _remove_unheld_lock(os.path.join(parent, name))


def mark(folder: str, command: str = "") -> None:
    """Mark ``folder`` as a result of ``command`` (which a later run of the same command may replace)."""
    with open(os.path.join(folder, MARKER), "w") as fh:
        json.dump({"written_by": command, "note": "written by the FedPM toolkit; a later run may replace it"}, fh)
        fh.write("\n")


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


@contextlib.contextmanager
def signals_deferred():
    """Within the block SIGINT and SIGTERM wait (they are delivered, and their handlers run, once it ends): for a
    step whose result must be known to be cleaned up (main thread only; elsewhere, or without signal masks, the
    block runs as it is)."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class ResultDir:
    """``with ResultDir(out) as tmp:`` write into ``tmp``; on success it becomes ``out``.

    The previous result (if any) survives until the new one is complete; on any exception
    (KeyboardInterrupt and SystemExit included) ``tmp`` is removed and ``out`` is as before."""

    def __init__(self, path: str, flag: str = "--out", marked: bool = True, kind: Kind | None = None):
        """``marked``: the folder carries MARKER (a later run may replace it); False for a folder that must
        never be replaced (its callers refuse an existing one).  ``kind``: the command and the files it writes
        (an existing folder is replaced only when it holds a previous result of that command alone)."""
        self.path = os.path.abspath(path)
        self.flag = flag
        self.shown = path
        self.marked = marked
        self.kind = kind
        check_out(path, flag, kind)

    def __enter__(self) -> str:
        self._term = sigterm_as_exit()
        self._term.__enter__()
        self._lock = exclusive(self.path, self.flag)
        try:
            self._lock.__enter__()
            self.tmp = None
            try:
                parent = os.path.dirname(self.path)
                clean_stale(parent)
                with signals_deferred():  # a SIGTERM or Ctrl-C here would leave a folder nobody knows the name of
                    self.tmp = tempfile.mkdtemp(prefix=f".partial-{os.getpid()}-", dir=parent)
                if self.marked:
                    mark(self.tmp, self.kind.command if self.kind else "")
            except BaseException:
                if self.tmp:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                self._lock.__exit__(None, None, None)
                raise
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
            try:
                self._lock.__exit__(None, None, None)
            finally:
                self._term.__exit__(None, None, None)

    def commit(self) -> None:
        check_out(self.shown, self.flag, self.kind)  # it may have changed while we computed
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
