"""What an offline W&B run logged, read from its `run-*.wandb` file (wandb 0.31 ships no reader of its own).

The file is a LevelDB-style log of `wandb_internal_pb2.Record` protobufs: a 7-byte file header (":W&B", magic,
version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC, length, type); a record too long for the rest
of a block is split into FIRST, MIDDLE and LAST chunks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B run file"
    found, pending, position = [], b"", HEADER
    while position + HEADER <= len(raw):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", raw[position : position + HEADER])
        if left < HEADER or (length == 0 and kind == 0):  # the block's zero-filled tail
            position += left
            continue
        pending += raw[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def history(path: Path) -> list[dict[str, Any]]:
    """Every `wandb.log` row, keys as logged."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records(path)
        if record.WhichOneof("record_type") == "history"
    ]


def run_names(path: Path) -> list[tuple[str, str]]:
    """(project, display name) of the run records."""
    return [(r.run.project, r.run.display_name) for r in records(path) if r.WhichOneof("record_type") == "run"]
