"""Telemetry chunks: how jobs hand metrics, samples and events to the panel through the store.

Records are buffered and written as numbered JSONL chunks at most every few seconds (and once more at the end), so
the panel's poller can list a stream with `start_after` and read each chunk exactly once. A failed write keeps the
records for the next attempt: a store outage delays telemetry but loses none of it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from jobs.contract import layout
from jobs.contract.layout import TelemetryStream
from jobs.store import ObjectStore, StoreError

log = logging.getLogger(__name__)


def next_sequence(store: ObjectStore, run_id: str, stream: TelemetryStream) -> int:
    """One past the highest chunk number already stored, so a restarted writer never overwrites a chunk."""
    highest = -1
    for info in store.list(layout.telemetry_prefix(run_id, stream)):
        seq = layout.parse_telemetry_seq(info.key)
        if seq is not None:
            highest = max(highest, seq)
    return highest + 1


def read_stream(store: ObjectStore, run_id: str, stream: TelemetryStream) -> list[dict[str, Any]]:
    """Every record of a JSONL stream, in the order written (what tests and benchmarks read back)."""
    return [
        record
        for info in store.list(layout.telemetry_prefix(run_id, stream))
        for record in decode_jsonl(store.get_bytes(info.key))
    ]


def encode_jsonl(records: list[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(record, default=str, allow_nan=True) + "\n" for record in records).encode()


def decode_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


class ChunkWriter:
    """Buffers the records of one stream and writes them as chunks, from a background thread or on demand."""

    def __init__(self, store: ObjectStore, run_id: str, stream: TelemetryStream, interval: float = 5.0):
        self.store, self.run_id, self.stream, self.interval = store, run_id, stream, interval
        self.seq = next_sequence(store, run_id, stream)
        self._buffer: list[Mapping[str, Any]] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            self._buffer.append(record)

    def flush(self) -> bool:
        """Write what is buffered as one chunk. Returns False (keeping the records) if the store refused."""
        with self._write_lock:
            with self._lock:
                records, self._buffer = self._buffer, []
            if not records:
                return True
            try:
                self.store.put_bytes(layout.telemetry_key(self.run_id, self.stream, self.seq), encode_jsonl(records))
            except StoreError as error:
                log.warning("telemetry %s: write failed, will retry (%s)", self.stream, error)
                with self._lock:
                    self._buffer[:0] = records
                return False
            self.seq += 1
            return True

    def start(self) -> ChunkWriter:
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{self.stream}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # a background loop survives a failed iteration
                log.exception("telemetry %s: flush failed", self.stream)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for _ in range(3):
            if self.flush():
                return
        log.error("telemetry %s: %d records could not be written at exit", self.stream, len(self._buffer))
