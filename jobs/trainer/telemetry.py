"""What the trainer tells the panel: every logged metric, every consumed rollout sample, events and its status.

Metrics come from TRL's `on_log` (all of its names: reward, rewards/*, ratio, kl, perf/*, sample/*, rollout/*,
batch/*). Samples come from a thin wrapper around TRL's rollout queue (TRL 1.16 writes no completions table): it sees
every sample the trainer pulls, including those then dropped as stale. Each record carries the trainer `attempt`, so
after a resume the panel can drop what the lost attempt logged past the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jobs.runtime import write_status
from jobs.store import ObjectStore, StoreError
from jobs.telemetry import ChunkWriter
from jobs.trainer.callback import Callback
from jobs.trainer.episode_loop import TURN_VERSION
from jobs.trainer.rewards import RewardErrorRecord, completion_text

if TYPE_CHECKING:
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

MAX_TEXT_CHARS = 20_000  # a sample's prompt or completion beyond this is cut (the panel shows text, not novels)
STATUS_EVERY_S = 5.0


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def episode_text(completion: Any) -> str:
    """A completion as the sample browser shows it: the reply's text, or for an agent's episode each turn in order —
    what the model said, each tool call with its arguments (→), each tool's answer (←) — so a search finds any of
    them. TRL hands the whole episode over as one message list."""
    return turns_text(completion, episode_turns(completion))


def turns_text(completion: Any, turns: list[dict[str, Any]] | None) -> str:
    """`episode_text` from the completion's `episode_turns` (an agent run's or not) where they are built already:
    the reply's text unless a turn called a tool or answered one."""
    if turns is None or not any(_is_tool_turn(turn) for turn in turns):
        return completion_text(completion)
    lines = []
    for turn in turns:
        if turn["role"] == "tool":
            lines.append(f"← {turn['name']}: {turn['content']}")
            continue
        if turn["content"]:
            lines.append(turn["content"])
        for call in turn["tool_calls"]:
            arguments = call["arguments"]
            shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items()) if isinstance(arguments, dict) else arguments
            lines.append(f"→ {call['name']}({shown})")
    return "\n".join(lines)


def episode_turns(completion: Any, agent: bool = False) -> list[dict[str, Any]] | None:
    """An agent's episode turn by turn, as the panel stores it: each reply with its tool calls and the adapter
    version that generated it (the rollout loop notes it: a sync can land mid-episode), each tool's answer. In an
    `agent` run (one with tools) every episode has its turns, one that answered at once too; otherwise None for a
    completion that called no tool (a single reply)."""
    if isinstance(completion, str):
        return None
    if not agent and not any(_is_tool_turn(message) for message in completion):
        return None
    turns: list[dict[str, Any]] = []
    for message in completion:
        if message.get("role") == "tool":
            turns.append({"role": "tool", "name": str(message.get("name") or "tool"), "content": _content(message)})
            continue
        calls = [call.get("function", call) for call in message.get("tool_calls") or []]
        turns.append(
            {
                "role": "assistant",
                "content": _content(message),
                "tool_calls": [{"name": str(c.get("name", "?")), "arguments": c.get("arguments", {})} for c in calls],
                "version": message.get(TURN_VERSION),
            }
        )
    return turns


def _content(message: dict[str, Any]) -> str:
    return str(message.get("content") or "")[:MAX_TEXT_CHARS]


def _is_tool_turn(message: dict[str, Any]) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _text(messages: Any) -> str:
    if isinstance(messages, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in messages)[:MAX_TEXT_CHARS]
    return str(messages)[:MAX_TEXT_CHARS]


class Telemetry(Protocol):
    """What every training process reports through: `TrainerTelemetry` on the main process, `SilentTelemetry` on
    the others."""

    attempt: int
    step: int
    last_error: str | None

    def event(self, kind: str, message: str, level: str = "info", **fields: Any) -> None: ...

    def status(self, phase: str | None = None, force: bool = True, **details: Any) -> None: ...

    def fail(self, message: str) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TrainerTelemetry:
    """Owns the trainer's telemetry streams and its status file."""

    def __init__(self, store: ObjectStore, run_id: str, attempt: int, max_steps: int, interval: float = 3.0):
        self.store, self.run_id, self.attempt, self.max_steps = store, run_id, attempt, max_steps
        self.metrics = ChunkWriter(store, run_id, "metrics", interval).start()
        self.samples = ChunkWriter(store, run_id, "samples", interval).start()
        self.events = ChunkWriter(store, run_id, "events", interval).start()
        self.phase = "starting"
        self.step = 0
        self.last_error: str | None = None
        self.details: dict[str, Any] = {}
        self._status_at = 0.0
        self._lock = threading.Lock()

    def event(self, kind: str, message: str, level: str = "info", **fields: Any) -> None:
        self.events.add(
            {"time": time.time(), "attempt": self.attempt, "kind": kind, "level": level, "message": message, **fields}
        )

    def status(self, phase: str | None = None, force: bool = True, **details: Any) -> None:
        """Write status/trainer.json (throttled unless `force`). Never raises: status is best-effort."""
        with self._lock:
            if phase is not None:
                self.phase = phase
            self.details.update(details)
            now = time.time()
            if not force and now - self._status_at < STATUS_EVERY_S:
                return
            self._status_at = now
            payload = {
                "phase": self.phase,
                "step": self.step,
                "max_steps": self.max_steps,
                "attempt": self.attempt,
                "last_error": self.last_error,
                **self.details,
            }
        try:
            write_status(self.store, self.run_id, "trainer", payload)
        except StoreError:
            pass

    def fail(self, message: str) -> None:
        self.last_error = message
        self.event("error", message, level="error")
        self.status("failed")

    def flush(self) -> None:
        """Write every buffered record now (what the store refuses stays buffered for the next try)."""
        for writer in (self.metrics, self.samples, self.events):
            writer.flush()

    def close(self) -> None:
        for writer in (self.metrics, self.samples, self.events):
            writer.close()


class SilentTelemetry:
    """The telemetry of every training process but the main one: it records nothing.

    The main process reports for the whole job (TRL reduces every metric there, and only its rollout queue exists), so
    another rank writing would duplicate each record and race the main process for `status/trainer.json`.
    """

    attempt: int = 0
    step: int = 0
    last_error: str | None = None

    def event(self, kind: str, message: str, level: str = "info", **fields: Any) -> None:
        pass

    def status(self, phase: str | None = None, force: bool = True, **details: Any) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TelemetryCallback(Callback):
    """Forwards every log line to the metrics stream and keeps the status file's step current."""

    def __init__(self, telemetry: TrainerTelemetry):
        self.telemetry = telemetry

    def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, Any] | None = None, **_kwargs: Any) -> None:
        if logs:
            record = {"step": state.global_step, "time": time.time(), "attempt": self.telemetry.attempt}
            # Held-out scores (`eval_*`, added for Trackio and W&B by reporting.HeldOutReports) have their own stream.
            numbers = {key: value for key, value in logs.items() if isinstance(value, int | float)}
            record.update({key: _finite(value) for key, value in numbers.items() if not key.startswith("eval_")})
            self.telemetry.metrics.add(record)

    def on_step_end(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        self.telemetry.step = state.global_step
        self.telemetry.status("training", force=False)


class RecordingQueue:
    """Stands in for TRL's rollout queue: forwards `get` and `qsize`, and records each sample it hands out."""

    def __init__(
        self, queue: Any, telemetry: TrainerTelemetry, trainer: Any, max_staleness: int, episodes: bool = False
    ):
        self.queue, self.telemetry, self.trainer, self.max_staleness = queue, telemetry, trainer, max_staleness
        self.episodes = episodes  # a run with tools: every sample is an episode, kept turn by turn

    def qsize(self) -> int:
        size: int = self.queue.qsize()
        return size

    def get(self, *args: Any, **kwargs: Any) -> RolloutSample:
        sample: RolloutSample = self.queue.get(*args, **kwargs)
        try:
            self._record(sample)
        except Exception:  # recording must never break training
            pass
        return sample

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)

    def _record(self, sample: RolloutSample) -> None:
        version = int(self.trainer.model_version)
        staleness = version - int(sample.model_version)
        metrics = dict(sample.metrics or {})
        turns = episode_turns(sample.completion, self.episodes)
        self.telemetry.samples.add(
            {
                "step": int(self.trainer.state.global_step) + 1,  # the step this sample is pulled for
                "time": time.time(),
                "attempt": self.telemetry.attempt,
                "policy_version": int(sample.model_version),
                "staleness": staleness,
                "dropped": staleness > self.max_staleness,
                "group_id": int(sample.group_id),
                "prompt": _text(sample.prompt),
                "completion": turns_text(sample.completion, turns)[:MAX_TEXT_CHARS],
                "turns": turns,
                "reward": _finite(metrics.get("reward")),
                "rewards": {k[len("rewards/") :]: _finite(v) for k, v in metrics.items() if k.startswith("rewards/")},
                "advantage": _finite(float(sample.advantage)),
            }
        )


class RewardErrorForwarder:
    """Tails the JSONL file where rewards (in TRL's rollout child) report failures, and forwards them as events."""

    def __init__(self, path: str | os.PathLike[str], telemetry: Telemetry, interval: float = 2.0):
        self.path, self.telemetry, self.interval = Path(path), telemetry, interval
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reward-errors", daemon=True)

    def start(self) -> RewardErrorForwarder:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as handle:
            handle.seek(self._offset)
            lines = handle.readlines()
            self._offset = handle.tell()
        for line in lines:
            try:
                record: RewardErrorRecord = json.loads(line)
            except json.JSONDecodeError:
                continue
            message = f"reward {record.get('reward')} failed: {record.get('error')}"
            self.telemetry.event("reward_error", message, level="warning", row=record.get("row"))
            self.telemetry.last_error = message

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()
