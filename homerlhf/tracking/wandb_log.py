"""The history rows W&B wrote to a run's local transaction logs (``run-<id>.wandb``).

W&B writes every run, offline or online, to ``<dir>/wandb/*-<id>/run-<id>.wandb`` and has no API that
reads one back. A resumed run reads them to learn the last step this run id holds (W&B keeps steps
monotonic, so a step already there must not be logged again), and the tests read the logged values.

The format is LevelDB's log format (32 KiB blocks of records: crc32c, little-endian length, type
FULL/FIRST/MIDDLE/LAST) after a 7-byte ``:W&B`` header; each record is a ``wandb_internal_pb2.Record``
protobuf. A file cut short (the process was killed) ends at its last whole record.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

BLOCK = 32768
HEADER = 7  # ":W&B", a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zero fill, or a record cut short
            return
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


def history(path: str | Path) -> list[tuple[int, dict]]:
    """``(step, {key: value})`` of each history row in one ``.wandb`` file, in the order written."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if not data.startswith(b":W&B"):
        return []
    rows = []
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - a torn record: what came before it stands
            break
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            rows.append((int(record.history.step.num), items))
    return rows


def run_files(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """The transaction logs of ``run_id`` under ``wandb_dir`` (one per process that ran it), oldest first."""
    return sorted(Path(wandb_dir).glob(f"*-{run_id}/run-{run_id}.wandb"))


def run_history(wandb_dir: str | Path, run_id: str) -> list[tuple[int, dict]]:
    return [row for path in run_files(wandb_dir, run_id) for row in history(path)]


def last_step(wandb_dir: str | Path, run_id: str) -> int:
    """The highest step any local log of ``run_id`` holds (0: none)."""
    return max((step for step, _ in run_history(wandb_dir, run_id)), default=0)
