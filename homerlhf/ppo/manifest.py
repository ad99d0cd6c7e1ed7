"""A checkpoint's ``MANIFEST.json``: the record of what was written, and the check that a checkpoint
still is what was written.

:func:`write_manifest` lists every file of a checkpoint with its size and sha256; the checkpoint
writer calls it last (:mod:`homerlhf.ppo.checkpoint`), so a directory without a manifest is never
a finished checkpoint. :func:`checkpoint_problem` compares the files with it: every size first (a
file cut short or gone shows at a ``stat``), then every sha256 (a byte changed in place). Refusing
such a checkpoint in one line is :func:`homerlhf.ppo.checkpoint.verify_checkpoint`.

A file's hash is remembered within the process, keyed by its path, size, mtime and inode: the app
lists a run's checkpoints every few seconds and hashes each file once, not at every refresh.
"""

from __future__ import annotations

import hashlib
import json
import stat
import time
from pathlib import Path
from typing import Any, Optional, Sequence

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
_HASHES: dict[tuple[str, int, int, int], str] = {}  # (path, size, mtime_ns, inode) -> sha256
_HASHES_KEPT = 4096


_RACY_S = 2.0  # a file changed this recently may change again within its timestamp's tick: not remembered


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()  # hashlib.file_digest is Python 3.11+; we support 3.10
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _remembered_sha256(path: Path, st) -> str:
    """The file's sha256, remembered while its path, size, mtime and inode stay the same. A file whose
    mtime is within ``_RACY_S`` of now is hashed every time (git's rule for racy files): a rewrite of the
    same size within one timestamp tick (coarse on older kernels) would otherwise keep its old hash."""
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _HASHES:
        return _HASHES[key]
    digest = sha256_of(path)
    if time.time() - st.st_mtime_ns / 1e9 > _RACY_S:
        if len(_HASHES) >= _HASHES_KEPT:
            _HASHES.clear()
        _HASHES[key] = digest
    return digest


def write_manifest(directory: Path, iteration: int) -> Path:
    """``directory/MANIFEST.json``: every file under ``directory`` with its size and sha256."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    manifest = directory / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT_VERSION, "iteration": iteration, "files": files}, indent=1))
    return manifest


def read_manifest(ckpt: Path) -> Optional[dict[str, Any]]:
    try:
        manifest = json.loads((Path(ckpt) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and manifest.get("format") == FORMAT_VERSION
    return manifest if ok and isinstance(manifest.get("files"), dict) else None


def checkpoint_problem(ckpt: str | Path, files: Sequence[str] = (), hashes: bool = True) -> Optional[str]:
    """What makes ``ckpt`` differ from what was written, in a few words naming the file; None if nothing.

    ``files``: the manifest entries to check, each a path or a folder prefix (``"actor/"``) relative
    to the checkpoint; empty: all of them. ``hashes``: compare sha256 too, not only sizes.
    """
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    if manifest is None:
        return f"{MANIFEST} is missing or unreadable (not a finished checkpoint)"
    listed = {rel: meta for rel, meta in manifest["files"].items()
              if not files or any(rel == f or (f.endswith("/") and rel.startswith(f)) for f in files)}
    stats = {}
    for rel, meta in listed.items():
        try:
            stats[rel] = (ckpt / rel).stat()
        except OSError:
            stats[rel] = None
        if stats[rel] is None or not stat.S_ISREG(stats[rel].st_mode):
            return f"{rel} is missing (its {MANIFEST} lists it)"
        if not isinstance(meta, dict):
            return f"{MANIFEST} is unreadable (its entry for {rel} is not a record)"
        if stats[rel].st_size != meta.get("bytes"):
            return (f"{rel} is {stats[rel].st_size} bytes, its {MANIFEST} says {meta.get('bytes')} "
                    "(cut short or changed after it was written)")
    for rel, meta in listed.items() if hashes else ():
        try:
            digest = _remembered_sha256(ckpt / rel, stats[rel])
        except OSError:
            return f"{rel} is missing (its {MANIFEST} lists it)"
        if digest != meta.get("sha256"):
            return f"{rel} does not match its {MANIFEST} sha256 (changed after it was written)"
    return None


def is_complete(ckpt: str | Path, verify_hashes: bool = False) -> bool:
    """A manifest is present and every file it lists exists with its recorded size (and hash)."""
    return checkpoint_problem(ckpt, hashes=verify_hashes) is None
