"""What to install for an optional part of the toolkit (its extras: dnn, flower, gpu), in one line that is right
for a clone and for an installed copy alike: the extra's requirements as this copy's metadata (or, in a clone
without one, its pyproject.toml) pins them, then the clone's own form."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shlex

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
_MARKER = re.compile(r"""^(?P<req>[^;]+?)\s*;\s*extra\s*==\s*["'](?P<extra>[\w-]+)["']\s*$""")


@functools.cache
def requirements(extra: str) -> tuple[str, ...]:
    """The requirements of the toolkit's ``extra``, e.g. ('torch<=2.13.0,>=2.1',); () where none is found."""
    try:
        listed = importlib.metadata.requires("fedpm") or []
    except importlib.metadata.PackageNotFoundError:
        listed = []
    found = [m["req"].strip() for m in map(_MARKER.match, listed) if m and m["extra"] == extra]
    if found:
        return tuple(found)
    try:
        with open(PYPROJECT, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return ()
    line = re.search(rf"^{re.escape(extra)}\s*=\s*\[(.*)\]\s*$", text, re.M)  # a requirement may hold [...]
    return tuple(re.findall(r'"([^"]+)"', line.group(1))) if line else ()


def install_hint(what: str, extra: str) -> str:
    """ "<what> is not installed (the [extra] extra): pip install '<requirement>' ...; in a clone: pip install -e
    '.[extra]'" -- the first form works wherever the toolkit is installed, the second only in its folder."""
    reqs = " ".join(shlex.quote(r) for r in requirements(extra) if not r.startswith("fedpm"))
    first = f"pip install {reqs}; in a clone of the toolkit, " if reqs else ""
    return f"{what} is not installed (the toolkit's [{extra}] extra): {first}pip install -e '.[{extra}]'"
