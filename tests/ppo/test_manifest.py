"""A checkpoint's manifest check: sizes then sha256, and which hashes are remembered."""

from __future__ import annotations

import hashlib
import os
import time

import homerlhf.ppo.manifest as M


def _sealed(tmp_path, data: bytes = b"weights 0\n"):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "adapter.bin").write_bytes(data)
    M.write_manifest(tmp_path, 1)
    return tmp_path / "actor" / "adapter.bin"


def _counting(monkeypatch) -> list[str]:
    hashed = []
    real = M.sha256_of
    monkeypatch.setattr(M, "sha256_of", lambda path: hashed.append(path.name) or real(path))
    return hashed


def test_sha256_is_the_files_and_is_read_in_blocks(tmp_path):
    data = os.urandom(3 * (1 << 20) + 17)  # more than one 1 MiB block
    (tmp_path / "big").write_bytes(data)
    assert M.sha256_of(tmp_path / "big") == hashlib.sha256(data).hexdigest()


def test_a_same_size_rewrite_within_the_timestamp_tick_is_seen(tmp_path, monkeypatch):
    """A file changed under 2 s ago is hashed at every check: rewritten with its size and (as a coarse
    kernel clock leaves it) its mtime unchanged, it is still refused."""
    path = _sealed(tmp_path)
    hashed = _counting(monkeypatch)
    assert M.checkpoint_problem(tmp_path) is None
    st = path.stat()
    path.write_bytes(b"weights 1\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert M.checkpoint_problem(tmp_path) == ("actor/adapter.bin does not match its MANIFEST.json sha256 "
                                              "(changed after it was written)")
    assert hashed == ["adapter.bin", "adapter.bin"]


def test_an_older_files_hash_is_remembered_until_its_stat_changes(tmp_path, monkeypatch):
    path = _sealed(tmp_path)
    old = time.time_ns() - 60 * 10**9
    os.utime(path, ns=(old, old))
    hashed = _counting(monkeypatch)
    assert M.checkpoint_problem(tmp_path) is None and M.checkpoint_problem(tmp_path) is None
    assert hashed == ["adapter.bin"]  # the app's lists refresh every few seconds: hashed once
    path.write_bytes(b"weights 1\n")  # same size, a new mtime
    assert "does not match" in M.checkpoint_problem(tmp_path)


def test_an_entry_that_is_not_a_record_is_a_problem_not_a_crash(tmp_path):
    _sealed(tmp_path)
    manifest = (tmp_path / M.MANIFEST).read_text().replace('"actor/adapter.bin": {', '"actor/adapter.bin": [{', 1)
    manifest = manifest.replace("}\n }", "}]\n }", 1)
    (tmp_path / M.MANIFEST).write_text(manifest)
    assert M.read_manifest(tmp_path) is not None
    assert M.checkpoint_problem(tmp_path) == "MANIFEST.json is unreadable (its entry for actor/adapter.bin is not a record)"
