"""The one archive in which ``validation/gpu_checks.sh`` carries its results from one job to the next.

A GPU job hands back at most 8 files of at most 16 MiB each, at most two folders down, so the script works in a
scratch folder and, after every unit, refreshes ``results.tar.gz`` at the top of its output folder: the whole
scratch folder (the figures' files, the done markers, the stacks' histories and the checkpoints of the unfinished
ones, the log) and a
manifest naming the device that produced it.  A later job given that archive (``PREVIOUS``) unpacks it and
continues where the first stopped.  A 3-run SimpleCNN FedPM stack's checkpoints take 8.6 MiB (the clients'
parameters stand in for their FOOF matrices: fedpm_dnn.engine.checkpoint.compact_client); an archive over 16 MiB is
written in volumes of 16 MiB, ``results.tar.gz``, ``results.tar.gz.2``, ... (at most
``MAX_VOLUMES``), which unpacking reads in order.

    python -m validation.gpu_archive device                       # the device's name (CUDA's, or 'CPU')
    python -m validation.gpu_archive pack WORK ARCHIVE DEVICE     # WORK -> ARCHIVE, atomically, within the limits
    python -m validation.gpu_archive unpack ARCHIVE WORK DEVICE   # ARCHIVE -> WORK, refused from another device

Limits (``MAX_VOLUMES`` volumes of ``MAX_BYTES``): an archive that would exceed them is not written (the previous
one stays) and the command exits 1 naming the largest files.  Unpacking refuses, in one line, an archive from a
device of another name (an H100's figures are never compared with, or continued on, an H200), a member outside
WORK, a link or a special file.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

MAX_BYTES = 16 * 2**20  # a volume
MAX_VOLUMES = 6  # with the log beside them, under 8 files
MANIFEST = "gpu_archive.json"
NAME = "results.tar.gz"


class ArchiveError(ValueError):
    """The archive cannot be written or used; the message says why in one line."""


def device_name() -> str:
    """CUDA's name for device 0, or 'CPU' where no CUDA device is visible."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def _files(work: str) -> list:
    out = []
    for root, dirs, files in os.walk(work):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(root, f)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            rel = os.path.relpath(path, work)
            if rel != MANIFEST and not rel.endswith(".tmp") and not _finished_checkpoint(work, rel):
                out.append(rel)
    return out


def _finished_checkpoint(work: str, rel: str) -> bool:
    """Whether ``rel`` is a checkpoint of a stack unit that has finished (stacks/<unit>/<run>/checkpoint.pt with
    done/<unit>): nothing continues it, so it does not travel (its history and summary do)."""
    parts = rel.split(os.sep)
    return (
        len(parts) == 4
        and parts[0] == "stacks"
        and parts[3] == "checkpoint.pt"
        and os.path.isfile(os.path.join(work, "done", parts[1]))
    )


def volumes(archive: str) -> list:
    """The volumes of ``archive`` that exist, in order: ARCHIVE, ARCHIVE.2, ARCHIVE.3, ..."""
    out = [archive] if os.path.isfile(archive) else []
    while out and os.path.isfile(f"{archive}.{len(out) + 1}"):
        out.append(f"{archive}.{len(out) + 1}")
    return out


def pack(work: str, archive: str, device: str, limit: int = MAX_BYTES, max_volumes: int = MAX_VOLUMES) -> int:
    """WORK's files and a manifest into ``archive`` (gzip tar, in volumes of ``limit`` bytes) via temporary files
    renamed over the old volumes; returns its size.  Over ``max_volumes`` volumes: ArchiveError naming the largest
    files, and the previous archive left as it was."""
    files = _files(work)
    manifest = json.dumps({"device": device, "files": len(files)}).encode()
    tmp = archive + ".tmp"
    parts = []
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
            info = tarfile.TarInfo(MANIFEST)
            info.size = len(manifest)
            tar.addfile(info, io.BytesIO(manifest))
            for rel in files:
                tar.add(os.path.join(work, rel), arcname=rel, recursive=False)
        size = os.path.getsize(tmp)
        if size > limit * max_volumes:
            big = sorted(files, key=lambda r: -os.path.getsize(os.path.join(work, r)))[:3]
            sizes = ", ".join(f"{r} {os.path.getsize(os.path.join(work, r)) / 2**20:.1f} MiB" for r in big)
            raise ArchiveError(
                f"{archive}: would be {size / 2**20:.1f} MiB, over {max_volumes} volumes of {limit / 2**20:.0f} MiB "
                f"(largest: {sizes}); the previous archive is kept"
            )
        with open(tmp, "rb") as src:
            while chunk := src.read(limit):
                parts.append(f"{tmp}.{len(parts) + 1}")
                with open(parts[-1], "wb") as dst:
                    dst.write(chunk)
        old = volumes(archive)
        for i, part in enumerate(parts):  # the first volume last: a reader never finds a new head on old volumes
            if i:
                os.replace(part, f"{archive}.{i + 1}")
        os.replace(parts[0], archive)
        for stale in old[len(parts) :]:
            os.remove(stale)
        return size
    finally:
        for leftover in [tmp, *parts]:
            if os.path.exists(leftover):
                os.remove(leftover)


def _member_ok(m: tarfile.TarInfo) -> bool:
    parts = m.name.split("/")
    return (m.isfile() or m.isdir()) and not os.path.isabs(m.name) and ".." not in parts and m.name not in ("", ".")


def unpack(archive: str, work: str, device: str) -> int:
    """``archive``'s files into ``work``; refused (ArchiveError) where it came from a device named otherwise, or
    holds anything but plain files and folders inside ``work``.  Returns the number of files."""
    try:
        stream = io.BytesIO(b"".join(Path(v).read_bytes() for v in volumes(archive)) or Path(archive).read_bytes())
        tar = tarfile.open(fileobj=stream, mode="r:gz")
    except (OSError, tarfile.TarError) as exc:
        raise ArchiveError(f"{archive}: not a results archive ({type(exc).__name__})") from None
    with tar:
        try:
            members = tar.getmembers()
            mf = tar.extractfile(MANIFEST) if MANIFEST in tar.getnames() else None
            manifest = json.loads(mf.read()) if mf is not None else None
        except (OSError, tarfile.TarError, ValueError) as exc:
            raise ArchiveError(f"{archive}: damaged archive ({type(exc).__name__})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("device"), str):
            raise ArchiveError(f"{archive}: no manifest naming its device; not an archive of gpu_checks.sh")
        if manifest["device"] != device:
            raise ArchiveError(
                f"{archive}: its results were measured on {manifest['device']!r}, this machine is {device!r}; "
                "results of different devices are never mixed: continue on the same device or start a fresh OUT"
            )
        bad = [m.name for m in members if not _member_ok(m)]
        if bad:
            raise ArchiveError(f"{archive}: refused: {bad[0]!r} is not a plain file inside the archive's folder")
        files = [m for m in members if m.isfile() and m.name != MANIFEST]
        for m in files:
            dest = os.path.join(work, m.name)
            os.makedirs(os.path.dirname(dest) or work, exist_ok=True)
            with tar.extractfile(m) as src, open(dest, "wb") as dst:
                dst.write(src.read())
        return len(files)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m validation.gpu_archive device | pack WORK ARCHIVE DEVICE | unpack ARCHIVE WORK DEVICE"
    try:
        if argv == ["device"]:
            print(device_name())
        elif len(argv) == 4 and argv[0] == "pack":
            size = pack(argv[1], argv[2], argv[3])
            print(f"{argv[2]}: {size / 2**20:.2f} MiB")
        elif len(argv) == 4 and argv[0] == "unpack":
            n = unpack(argv[1], argv[2], argv[3])
            print(f"{argv[1]}: {n} files into {argv[2]}")
        else:
            print(usage, file=sys.stderr)
            return 2
    except ArchiveError as exc:
        print(f"gpu_archive: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
