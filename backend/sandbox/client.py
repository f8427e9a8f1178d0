"""The reward sandbox: run reward functions on sample rows before anything is launched.

User code runs in a separate Python process with:
- no secrets (a minimal environment, no inherited descriptor) and a scratch working directory;
- a time limit (wall clock, enforced by killing it, and CPU time via RLIMIT_CPU);
- a memory limit (RLIMIT_AS) and an output limit (RLIMIT_FSIZE on its stdout/stderr files: printing megabytes ends
  the run with a clear message);
- no network, no process, no file outside its folder: the process confines itself before user code is imported
  (jobs/confinement/confine.py: its own user and network namespace, Landlock, a seccomp filter), and an audit hook
  refuses sockets, subprocesses and signals with a clear message.

The result is per reward and per row: a score, or the error with the offending row.
"""

from __future__ import annotations

import json
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from backend.hosting import on_space
from jobs.confinement import landlock, python_paths, run_confined
from jobs.confinement.confine import UNCONFINABLE_EXIT, Confinement
from jobs.contract import EnvironmentSpec, RewardSpec

if TYPE_CHECKING:  # what the runner reads from request.json and writes to result.json, in its shapes
    from backend.sandbox.runner import EnvironmentResult, Request, RewardsResult

RUNNER = Path(__file__).with_name("runner.py")


@dataclass(frozen=True)
class SandboxLimits:
    seconds: float = 10.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20


@dataclass(frozen=True)
class Subject:
    """What ran in the sandbox, in the words its limits' messages use: who was stopped, and what to do."""

    name: str
    fix: str


REWARDS = Subject("the rewards", "make the reward faster (it runs for every group during training)")
TOOLS = Subject("the environment's sample calls", "make the tools faster (they run on every turn during training)")


@dataclass
class RewardTrial:
    """What one reward did on the sample rows: `scores` (one per row), or `error` (and the `row` it concerns)."""

    name: str
    scores: list[float | None] = field(default_factory=list)
    error: str | None = None
    row: int | None = None


class SandboxError(RuntimeError):
    """The sandbox itself failed (timeout, memory, output limit) for every reward at once."""


def confinement(limits: SandboxLimits, scratch: Path, strict: bool) -> Confinement:
    """What the sandboxed interpreter may use: its limits, and the paths it may touch (read Python and the job code,
    write its scratch folder). `strict` (a shared panel): refuse to run user code where it cannot be confined."""
    paths = python_paths(scratch) | {str(RUNNER): landlock.READ_FILE}
    return Confinement(limits.seconds, limits.memory_bytes, limits.output_bytes, paths, strict)


def run_rewards(
    rewards: list[RewardSpec],
    rows: list[dict[str, Any]],
    completions: list[str] | list[list[dict[str, Any]]],
    limits: SandboxLimits = SandboxLimits(),
    eos_token_ids: list[int] | None = None,
    completion_ids: list[list[int]] | None = None,
) -> list[RewardTrial]:
    """Score `completions` (one per row: a reply's text, or an agent's episode as its messages) with each reward, in
    the sandbox. Without their token ids (a check on sample rows has none) each completion counts a token per word,
    ending in EOS."""
    if len(rows) != len(completions):
        raise ValueError("give one completion per row")
    columns: dict[str, list[Any]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "prompt":
                columns.setdefault(key, []).append(value if isinstance(value, str | int | float | bool) else str(value))
    request: Request = {
        "rewards": [reward.model_dump() for reward in rewards],
        "completions": completions,
        "prompts": [row.get("prompt") for row in rows],
        "completion_ids": completion_ids
        or [list(range(max(1, len(str(text).split())))) + (eos_token_ids or [])[:1] for text in completions],
        "columns": {key: values for key, values in columns.items() if len(values) == len(rows)},
        "eos_token_ids": eos_token_ids or [],
    }
    result = cast("RewardsResult", _sandboxed(request, limits, len(rows)))
    trials = []
    for reward in rewards:
        entry = result["rewards"].get(reward.name, {"error": "the reward did not run"})
        error = _explain_error(entry.get("error"), limits)
        trials.append(RewardTrial(reward.name, entry.get("scores") or [], error, entry.get("row")))
    return trials


def rehearse_environment(environment: EnvironmentSpec, rows: list[dict[str, Any]], limits: SandboxLimits) -> list[str]:
    """Load the user's environment code in the sandbox, check its tools as TRL will use them, start an episode from
    each sample row and call every tool once (jobs/environments/loading.py's `rehearse`); the calls made, or
    SandboxError naming the field and the fix."""
    request: Request = {"environment": environment.model_dump(), "rows": rows}
    result = cast("EnvironmentResult", _sandboxed(request, limits, len(rows), TOOLS))
    if result.get("error"):
        raise SandboxError(_explain_error(str(result["error"]), limits) or "")
    return [str(call) for call in result.get("calls", [])]


def _sandboxed(request: Request, limits: SandboxLimits, rows: int, subject: Subject = REWARDS) -> dict[str, Any]:
    """Run the runner on `request` in a fresh scratch folder, confined; its result, or SandboxError saying why none."""
    with tempfile.TemporaryDirectory(prefix="reward-sandbox-") as folder:
        scratch = Path(folder)
        request["confinement"] = confinement(limits, scratch, strict=on_space()).to_json()
        with open(scratch / "stdout", "wb") as out:
            code, burned = run_confined(RUNNER, scratch, request, limits.seconds, out)
        if code is None:
            raise SandboxError(stopped_by_the_clock(burned, limits, rows, subject))
        result_path = scratch / "result.json"
        if code != 0 or not result_path.exists():
            raise SandboxError(_explain_exit(code, scratch / "stdout", limits, subject))
        return dict(json.loads(result_path.read_text()))


def _explain_error(error: str | None, limits: SandboxLimits) -> str | None:
    """Say what a limit hit means for the user, instead of the bare OS error."""
    if error is None:
        return None
    if "File too large" in error:
        return f"the reward printed more than {limits.output_bytes // 1024} kB; remove the prints from the reward"
    if error.startswith("MemoryError"):
        return f"the reward needed more than {limits.memory_bytes >> 20} MB of memory"
    return error


def stopped_by_the_clock(cpu_seconds: float, limits: SandboxLimits, rows: int, subject: Subject = REWARDS) -> str:
    """Why rewards the wall-clock deadline stopped were stopped: a reward that had burned its CPU allowance is named
    as such (the deadline came first only because the machine was busy), any other was slow or waiting."""
    if cpu_seconds >= limits.seconds:
        return _cpu_exceeded(limits, subject)
    return f"{subject.name} took longer than {limits.seconds:.0f}s on {rows} rows and were stopped; {subject.fix}"


def _cpu_exceeded(limits: SandboxLimits, subject: Subject = REWARDS) -> str:
    return f"{subject.name} used more than {limits.seconds:.0f}s of CPU and were stopped; {subject.fix}"


def _explain_exit(code: int, output: Path, limits: SandboxLimits, subject: Subject = REWARDS) -> str:
    tail = output.read_bytes()[-1500:].decode(errors="replace").strip()
    if code == UNCONFINABLE_EXIT:
        return (
            f"this server cannot confine reward code ({tail[-300:]}), so code rewards are off here; use a built-in "
            "reward, or run the panel on your own machine"
        )
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or output.stat().st_size >= limits.output_bytes:
        return f"the reward printed more than {limits.output_bytes // 1024} kB; remove the prints from the reward"
    if code in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU):
        return _cpu_exceeded(limits, subject)
    if "MemoryError" in tail or code == -signal.SIGSEGV:
        return f"the rewards needed more than {limits.memory_bytes >> 20} MB of memory"
    return f"the reward sandbox failed (exit code {code}): {tail[-600:]}"
