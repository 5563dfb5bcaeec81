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
        _raise_write_error(path, exc)


def _raise_write_error(path: str, exc: BaseException):
    raised = write_error(path, exc)
    if raised is exc:
        raise exc
    raise raised from None


class FolderSwapped(ValueError):
    """An output folder held by ``held_folder`` no longer stands at its path (replaced by a link or another
    folder, moved, removed); the message names it."""


_DIR_FDS = {os.open, os.rename, os.unlink} <= os.supports_dir_fd and hasattr(os, "O_DIRECTORY")


class HeldFolder:
    """An output folder pinned by identity (device, inode) and, where the platform allows, by a descriptor held
    open: writes go into this folder whatever its path names later."""

    def __init__(self, path: str, flag: str):
        self.path, self.flag = path, flag
        nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise FolderSwapped(f"{flag} {path}: is not a folder (a symbolic link?); give the real folder")
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | nofollow) if _DIR_FDS else None
        if self.fd is not None:
            st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)

    def problem(self) -> str | None:
        """What happened to the folder's path since it was held, or None while it still names the folder."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return "was moved or removed"
        if stat.S_ISLNK(st.st_mode):
            return "was replaced by a symbolic link"
        if (st.st_dev, st.st_ino) != self.identity:
            return "was replaced by another folder"
        return None

    def move_in(self, src: str) -> str:
        """Move the finished file ``src`` (written elsewhere on the same file system) into this folder under its
        own name, replacing one there; FolderSwapped when the path no longer names the folder.  Returns its path."""
        self.check()
        name = os.path.basename(src)
        if self.fd is None:
            os.replace(src, os.path.join(self.path, name))
        else:
            os.rename(src, name, dst_dir_fd=self.fd)  # replaces on POSIX, as os.replace
        return os.path.join(self.path, name)

    def check(self) -> None:
        why = self.problem()
        if why:
            raise FolderSwapped(
                f"{self.flag} {self.path}: {why} while this run was writing into it; stopped without writing "
                "there (what this run wrote stays in the folder it began in)"
            )


_HELD: dict = {}  # absolute path -> HeldFolder, for written_atomically


@contextmanager
def held_folder(path: str, flag: str = "--out"):
    """Within the block ``path`` is a held output folder: every ``written_atomically`` into it (also from deep
    in a library, e.g. a round driver's checkpoint) first checks that ``path`` still names the folder it named
    when the block began and writes through the descriptor held on it, so a path swapped under a running command
    for a link or someone else's folder is never followed: the write is refused with FolderSwapped instead.
    Yields the HeldFolder."""
    key = os.path.abspath(path)
    folder = HeldFolder(path, flag)
    _HELD[key] = folder
    try:
        yield folder
    finally:
        if _HELD.get(key) is folder:
            del _HELD[key]
        if folder.fd is not None:
            os.close(folder.fd)


@contextmanager
def written_atomically(path: str, mode: str = "w"):
    """``with written_atomically(path, mode) as fh:`` the file object to write the new contents of ``path``
    into; they replace ``path`` in one rename when the block ends (``replaced_atomically``).  Into a folder held
    by ``held_folder`` the write is checked and made through its descriptor (O_NOFOLLOW)."""
    folder = _HELD.get(os.path.dirname(os.path.abspath(path)))
    if folder is None:
        with replaced_atomically(path) as tmp, open(tmp, mode) as fh:
            yield fh
        return
    folder.check()
    if folder.fd is None:  # no descriptor-relative calls here: the check above is all there is
        with replaced_atomically(path) as tmp, open(tmp, mode) as fh:
            yield fh
        return
    name = os.path.basename(path)
    tmp = f"{name}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o666, dir_fd=folder.fd), mode) as fh:
            yield fh
        folder.check()
        os.rename(tmp, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)  # replaces on POSIX, as os.replace
    except BaseException as exc:
        try:
            os.unlink(tmp, dir_fd=folder.fd)
        except OSError:
            pass
        _raise_write_error(path, exc)


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


def not_a_file(path: str) -> str:
    """What ``path``, which is not (a link to) a regular file, is instead, as the rest of a line naming it."""
    if not os.path.lexists(path):
        return "no such file"
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:  # a link to nothing, a link loop, a folder not to be entered
        if os.path.islink(path):
            return "is a symbolic link to nothing" if exc.errno == errno.ENOENT else "is a symbolic-link loop"
        return f"cannot be read ({exc.strerror})"
    return f"is {_kind(mode)}, not a regular file"


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


def memory_bytes() -> int:
    """The machine's physical memory (16 GiB where the platform does not say): what sizes read from a file
    are bounded by."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


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
