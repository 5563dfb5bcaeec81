"""Writing a file so that readers see the old one or the new one, never half of one."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def replaced_atomically(path: str, tmp: str | None = None):
    """``with replaced_atomically(path) as tmp:`` write the new contents to ``tmp``; when the block ends they
    replace ``path`` in one rename.  On any exception (an error, a full disk, Ctrl-C) ``tmp`` is removed and
    ``path`` is as before.  ``tmp`` defaults to a per-process name beside ``path``, so two processes writing the
    same file (a shared cache) never write into one temporary file."""
    tmp = f"{path}.{os.getpid()}.tmp" if tmp is None else tmp
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
