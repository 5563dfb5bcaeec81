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
Ctrl-C, SIGTERM); after a kill -9 the next run in the same parent folder removes those it can prove a process
of this tool made and left: a temporary folder holding a marker (``.fedpm-temp``) with the pid and start time of
a process that no longer runs (a previous result moved aside is put back first when nothing stands in its
place), and a lock file nobody holds that names a pid.  Anything else of such a name is left alone, and these
names are refused as ``--out`` (``reserved_name``).  A lock file is never opened through a symbolic link.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # no advisory locks on this platform: runs are not serialised there
    fcntl = None

MARKER = ".fedpm-result"
TEMP_MARKER = ".fedpm-temp"  # inside a temporary folder: the process that made it (temp_folder)
_TEMP = re.compile(r"^\.(partial|old)-(\d+)-")
_LOCK = re.compile(r"^\..+\.fedpm-lock$")
LOCK_SUFFIX = ".fedpm-lock"
NAME_MAX = 255  # bytes in one path component on the usual file systems


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


def reserved_name(name: str) -> str | None:
    """Why ``name`` (one path component) may not name a result folder, or None: the names of this tool's
    temporary folders, lock files and markers (which its clean-up may remove), and names too long for the lock
    file beside them."""
    if _TEMP.match(name) or _LOCK.match(name) or name in (MARKER, TEMP_MARKER):
        return f"{name}: a name this tool reserves for its temporary folders, locks and markers; choose another"
    room = NAME_MAX - len("." + LOCK_SUFFIX)
    if len(os.fsencode(name)) > room:
        return f"{name[:20]}...: a name of {len(os.fsencode(name))} bytes; at most {room} (its lock file must fit)"
    return None


def check_out(path: str, flag: str = "--out", kind: Kind | None = None) -> None:
    """Raise OutputError unless ``path`` may receive ``kind``'s results: absent, empty, or a previous result of the
    same command holding only its own files (``kind`` None: any folder of ours)."""
    if not path or not str(path).strip():
        raise OutputError(f"{flag}: empty path")
    why = reserved_name(os.path.basename(os.path.abspath(path)))
    if why:
        raise OutputError(f"{flag} {path}: {why}")
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
# seconds a run waits for a lock whose run has ended but which a process forked by that run still holds
ORPHAN_WAIT = 10.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (Linux: field 22 of /proc/<pid>/stat, clock ticks since boot), telling it from a
    later process given the same pid; None where the platform does not say or no such process runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return data[data.rindex(b")") + 2 :].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return None


def _stamp() -> str:
    """This process, as a lock file and a temporary folder's marker record it."""
    return json.dumps({"pid": os.getpid(), "start": start_time(os.getpid())})


def _runs(pid: int, start) -> bool:
    """Whether the process ``pid`` that started at ``start`` (None: unknown) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = start_time(pid)
    return start is None or now is None or now == start


def _made_dirs(folder: str) -> list:
    """Create ``folder`` and its missing parents; the ones this call created, deepest first."""
    missing = []
    while folder and not os.path.lexists(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    if missing:
        os.makedirs(missing[0], exist_ok=True)
    return missing


def _open_lock(lock: str, path: str, flag: str) -> int:
    """The lock file's descriptor: created if absent, never through a symbolic link, and only a regular file of
    one link (a hard link to someone's file would be truncated below)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
    except OSError as exc:
        if os.path.islink(lock) or exc.errno == errno.ELOOP:
            raise OutputError(
                f"{flag} {path}: its lock file {lock} is a symbolic link, never followed; remove the link"
            ) from None
        raise OutputError(f"{flag} {path}: its lock file {lock} cannot be opened ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "has other hard links" if stat.S_ISREG(st.st_mode) else "is not a regular file"
        raise OutputError(f"{flag} {path}: its lock file {lock} {what}; it is not this tool's: remove it")
    os.set_blocking(fd, True)
    return fd


@contextlib.contextmanager
def exclusive(path: str, flag: str = "--out"):
    """Within the block this process alone writes ``path``: a second run asking for the same folder is refused
    with OutputError naming the process that holds it.  The lock (``flock`` on a hidden file beside ``path``,
    never opened through a link) ends with the process however it ends; the file is removed on exit, or by the
    next run after a kill -9, and so are the parent folders the block created when they are left empty.  A lock
    still held after its run has ended (by a process that run forked) is waited for up to ORPHAN_WAIT seconds.  A
    block within one of the same process that holds it already just goes on."""
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
    try:
        made = _made_dirs(os.path.dirname(lock))
    except OSError as exc:
        raise OutputError(f"{flag} {path}: its folder cannot be created ({exc.strerror})") from None
    orphan_deadline = None
    try:
        while True:
            fd = _open_lock(lock, path, flag)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                held_by = os.read(fd, 256).decode("ascii", "replace").strip()
                os.close(fd)
                who = _stamped(held_by)
                if who is not None and not _runs(*who):
                    # the run that took the lock has ended, but a process it forked holds the descriptor still: a
                    # child killed with it between fork and exec (starting git, say), about to let go
                    if orphan_deadline is None:
                        orphan_deadline = time.monotonic() + ORPHAN_WAIT
                    if time.monotonic() < orphan_deadline:
                        time.sleep(0.05)
                        continue
                    raise OutputError(
                        f"{flag} {path}: its run (pid {who[0]}) has ended, but a process it started still holds its "
                        f"lock; wait for that process to end or choose another {flag}"
                    ) from None
                try:
                    holder = json.loads(held_by)["pid"]
                except (ValueError, TypeError, KeyError):
                    holder = held_by or "?"
                raise OutputError(
                    f"{flag} {path}: another run (pid {holder}) is writing into it; wait for it to end or choose "
                    f"another {flag}"
                ) from None
            try:  # its previous holder may have removed the file between our open and our lock: take the new one
                same = os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{_stamp()}\n".encode())
            _HELD[lock] = (os.getpid(), 1)
            yield
        finally:
            _HELD.pop(lock, None)
            with contextlib.suppress(OSError):
                os.remove(lock)
            os.close(fd)
    finally:
        for folder in made:  # deepest first; a folder that now holds anything stays
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _remove_unheld_lock(path: str) -> None:
    """A lock file of ours that no process holds (its run was killed with -9) is removed, as ``exclusive`` would:
    only a regular file of one link (never a link's target) that names a pid."""
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        text = os.read(fd, 256).decode("ascii", "replace").strip()
        if not (text.isdigit() or _stamped(text)):  # a pid (earlier versions) or _stamp's record
            return
        if os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
            os.remove(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def _stamped(text: str):
    """The (pid, start) of a ``_stamp`` record (also within a temporary folder's marker), or None when ``text`` is
    not one."""
    try:
        info = json.loads(text)
    except ValueError:
        return None
    if not isinstance(info, dict) or type(info.get("pid")) is not int:
        return None
    if info.get("start") is not None and not isinstance(info["start"], str):
        return None
    return info["pid"], info.get("start")


def temp_folder(parent: str, kind: str, target: str | None = None) -> str:
    """A new private folder ``.<kind>-<pid>-*`` in ``parent`` (kind: partial, old) holding the marker that proves
    this process made it (``TEMP_MARKER``: its pid and start time, and the name of the folder it stands for), so
    that after a kill -9 the next run removes it (``clean_stale``) and nothing else of such a name."""
    folder = None
    try:
        # a SIGTERM or Ctrl-C before ``folder`` is named would leave a folder nobody knows the name of; held back,
        # it is raised as the block ends, when the name is known here
        with signals_deferred():
            folder = tempfile.mkdtemp(prefix=f".{kind}-{os.getpid()}-", dir=parent)
            with open(os.path.join(folder, TEMP_MARKER), "x") as fh:
                fh.write(json.dumps({**json.loads(_stamp()), "target": target}) + "\n")
    except BaseException:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _left_by_dead_process(folder: str, pid: int):
    """The marker of ``folder`` when it proves the folder a temporary one of a process ``pid`` that no longer runs
    (a real folder, not a link, whose regular marker file names that pid), else None."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        fd = os.open(os.path.join(folder, TEMP_MARKER), os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    who = _stamped(text)
    if who is None or who[0] != pid or _runs(*who):
        return None
    return json.loads(text)


def clean_stale(parent: str) -> None:
    """Remove what killed runs of this tool left in ``parent``: temporary folders whose marker names a process that
    no longer runs (a previous result moved aside is first put back where nothing stands in its place), and lock
    files nobody holds."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = _TEMP.match(name)
        if m:
            folder = os.path.join(parent, name)
            info = _left_by_dead_process(folder, int(m.group(2)))
            if info is None:
                continue
            target = info.get("target")
            previous = os.path.join(folder, "previous")
            if (
                m.group(1) == "old"
                and isinstance(target, str)
                and target == os.path.basename(target)
                and target not in ("", ".", "..")
                and os.path.isdir(previous)
                and not os.path.lexists(os.path.join(parent, target))
            ):
                with contextlib.suppress(OSError):  # killed between moving the old result aside and the new in
                    os.rename(previous, os.path.join(parent, target))
            shutil.rmtree(folder, ignore_errors=True)
        elif fcntl is not None and _LOCK.match(name):
            _remove_unheld_lock(os.path.join(parent, name))


def mark(folder: str, command: str = "") -> None:
    """Mark ``folder`` as a result of ``command`` (which a later run of the same command may replace)."""
    with open(os.path.join(folder, MARKER), "w") as fh:
        json.dump({"written_by": command, "note": "written by the FedPM toolkit; a later run may replace it"}, fh)
        fh.write("\n")


class SigtermExit(SystemExit):
    """SIGTERM within ``sigterm_as_exit``: exit status 143, after the cleanup code has run."""


def _send_soon(signum: int, delay: float = 0.05) -> None:
    timer = threading.Timer(delay, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def lost_signals_sent_again(signal_of):
    """Within the block, an exception that a signal handler raised where Python cannot propagate it (a __del__, a
    weakref or logging callback, an import's lock clean-up: printed as "Exception ignored" and dropped) has its
    signal sent again, to be raised at the next ordinary point -- from another thread, a moment later: sent from
    the hook, its handler would run inside the hook and be dropped the same way.  ``signal_of(exc)``: the signal
    that raised ``exc``, or None (then the previous hook reports it)."""
    hook = sys.unraisablehook

    def send_again(unraisable):
        signum = signal_of(unraisable.exc_value)
        if signum is None:
            hook(unraisable)
        else:
            _send_soon(signum)

    sys.unraisablehook = send_again
    try:
        yield
    finally:
        sys.unraisablehook = hook


@contextlib.contextmanager
def sigterm_as_exit():
    """Within the block SIGTERM raises SigtermExit (a SystemExit, status 143), so cleanup code runs (main thread
    only), also where it lands in a finalizer (``lost_signals_sent_again``).  A handler already installed stays
    (``common.run_command``'s raises ``Terminated``, cleaned up the same way and then reported in one line)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(signum, frame):
        raise SigtermExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        with lost_signals_sent_again(lambda exc: signal.SIGTERM if isinstance(exc, SigtermExit) else None):
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
                self.tmp = temp_folder(parent, "partial", os.path.basename(self.path))
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
        os.remove(os.path.join(self.tmp, TEMP_MARKER))  # the result itself holds only what its command writes
        old = None
        if os.path.lexists(self.path):
            old = temp_folder(os.path.dirname(self.path), "old", os.path.basename(self.path))
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
