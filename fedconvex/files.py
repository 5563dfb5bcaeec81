"""Files at the boundary: written so that readers see the old one or the new one, never half of one; read only
when they are what they claim to be (a regular file of bounded size, never a FIFO or a device)."""

from __future__ import annotations

import errno
import json
import os
import stat
from contextlib import contextmanager


def hidden_cause(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or OSError behind ``exc``, when ``exc`` is a writer's own error raised while handling
    it (torch's zip writer reports a full disk or a Ctrl-C as 'unexpected pos'; matplotlib's PDF writer as an
    AttributeError in its cleanup): the real cause, or None when there is none to find."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (KeyboardInterrupt, OSError)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def write_error(path: str, exc: BaseException) -> BaseException:
    """What a failed write of ``path`` raises: a Ctrl-C stays one; a disk error (also one hidden behind a writer's
    own error) becomes an OSError whose message names ``path`` and the cause; anything else is returned as it is."""
    cause = hidden_cause(exc)
    if isinstance(cause, KeyboardInterrupt):
        return cause  # itself (a SIGTERM raised as one keeps its kind)
    if isinstance(cause, OSError):
        why = cause.strerror or str(cause) or type(cause).__name__
        err = OSError(f"{path}: cannot be written ({why})")
        err.errno = cause.errno
        return err
    return exc


@contextmanager
def replaced_atomically(path: str, tmp: str | None = None):
    """``with replaced_atomically(path) as tmp:`` write the new contents to ``tmp``; when the block ends they
    replace ``path`` in one rename.  On any exception (an error, a full disk, Ctrl-C) ``tmp`` is removed and
    ``path`` is as before; a disk error is raised as an OSError naming ``path`` (``write_error``).  ``tmp``
    defaults to a per-process name beside ``path``, so two processes writing the same file (a shared cache) never
    write into one temporary file."""
    tmp = f"{path}.{os.getpid()}.tmp" if tmp is None else tmp
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raised = write_error(path, exc)
        if raised is exc:
            raise
        raise raised from None


class NotARegularFile(ValueError):
    """A data file that is not a regular file (a FIFO, a device, a folder, a symbolic-link loop) or is larger
    than it may be; the message names it."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, limit: int | None = None, error=NotARegularFile):
    """``path`` opened for binary reading, only if it is (or links to) a regular file of at most ``limit`` bytes;
    else ``error`` naming it.  Checked on the opened file itself (O_NONBLOCK: a FIFO swapped in after a check never
    blocks the open), so what is read is what was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{path}: is a symbolic-link loop, not a file") from None
        raise error(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: is {_kind(st.st_mode)}, not a regular file; remove it from the data folder")
        if limit is not None and st.st_size > limit:
            raise error(f"{path}: {st.st_size} bytes, more than the {limit} such a file may hold")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, limit: int | None = None, error=NotARegularFile) -> bytes:
    """The bytes of ``path`` (``open_regular``'s checks), never more than ``limit``."""
    with open_regular(path, limit, error) as fh:
        data = fh.read() if limit is None else fh.read(limit + 1)
    if limit is not None and len(data) > limit:  # grew since it was checked
        raise error(f"{path}: more than the {limit} bytes such a file may hold")
    return data


class DamagedFile(ValueError):
    """A file of ours (a result, a cache) that cannot be what it should be; the message names it and why."""


def read_json_object(path: str, limit: int = 256 * 2**20) -> dict:
    """The JSON object in the regular file ``path``, or DamagedFile naming the file and what is wrong with it."""
    data = read_regular(path, limit, error=DamagedFile)
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise DamagedFile(f"{path}: damaged (not JSON: {str(exc) or type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise DamagedFile(f"{path}: damaged (holds a JSON {type(obj).__name__}, not an object)")
    return obj
