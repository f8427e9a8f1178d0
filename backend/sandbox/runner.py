"""Runs inside the reward sandbox (see backend/sandbox/client.py); not imported by the panel.

    python -I runner.py <project root> <request.json> <result.json>

Before any user code runs, the runner confines itself (jobs/confinement/confine.py: namespaces, limits, Landlock,
seccomp), in its one thread, after exec; then an audit hook refuses network access, subprocesses and signals to other
processes with a clear message (the hook cannot be removed from Python; the OS layers hold past it).
"""

import errno
import json
import os
import sys
import traceback

# mypy reads TYPE_CHECKING as true; at run time the runner imports nothing more than the above before it confines
# itself, so the request's and result's shapes are types for the checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypedDict

    class Request(TypedDict, total=False):
        """What backend/sandbox/client.py writes to request.json: rewards to score completions with, or an
        environment to rehearse on sample rows."""

        rewards: list[dict[str, Any]]
        completions: list[str] | list[list[dict[str, Any]]]  # replies' texts, or agents' episodes as messages
        prompts: list[Any]
        completion_ids: list[list[int]]
        columns: dict[str, list[Any]]
        eos_token_ids: list[int]
        confinement: dict[str, Any]
        environment: dict[str, Any]
        rows: list[dict[str, Any]]

    class RewardOutcome(TypedDict, total=False):
        """One reward's entry in result.json: its scores, or the error it raised (and the row it was scoring)."""

        scores: list[float | None]
        error: str
        row: int  # InvalidScore.index (jobs/trainer/rewards.py)

    class RewardsResult(TypedDict):
        rewards: dict[str, RewardOutcome]

    class EnvironmentResult(TypedDict, total=False):
        """result.json of a rehearsal: the calls made, or what was wrong."""

        calls: list[str]
        error: str


def _explain(error: BaseException) -> str:
    """The error a reward raised, as the user should read it: what the OS refused is the sandbox's doing."""
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, OSError) and error.errno in (errno.EPERM, errno.EACCES):
        message += (
            " (the reward sandbox refused it: reward code may not start processes, run programs, open sockets, "
            "signal other processes or touch files outside its scratch folder)"
        )
    return message


def main(root: str, request_path: str, result_path: str) -> None:
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # nothing the launcher might have left open
    os.environ.clear()
    sys.path.insert(0, root)
    with open(request_path) as handle:
        request: Request = json.load(handle)
    from jobs.confinement.confine import (
        UNCONFINABLE_EXIT,
        Confinement,
        ConfinementUnavailable,
        confine,
        enter_namespaces,
    )

    enter_namespaces()  # first: the kernel refuses a new user namespace once a library has started a thread
    from jobs.confinement import audit
    from jobs.contract import RewardSpec
    from jobs.trainer.rewards import build_rewards, import_builtin_dependencies

    import_builtin_dependencies([spec["name"] for spec in request.get("rewards", [])])
    if "environment" in request:
        _load_schema_builder()
    try:
        confine(Confinement.from_json(request["confinement"]))
    except ConfinementUnavailable as error:
        print(error, flush=True)
        sys.exit(UNCONFINABLE_EXIT)
    audit.install("reward code")  # after our own built-ins' libraries loaded the C code (ctypes) user code may not
    if "environment" in request:
        rehearsal = _rehearse_environment(request)
        sys.stdout.flush()
        with open(result_path, "w") as handle:
            json.dump(rehearsal, handle)
        return
    completions = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in request["completions"]]
    columns = request["columns"]
    result: RewardsResult = {"rewards": {}}
    for spec_data in request["rewards"]:
        spec = RewardSpec.model_validate(spec_data)
        try:
            (reward,) = build_rewards([spec], request.get("eos_token_ids") or [])
            scores = reward.score(
                completions, prompts=request["prompts"], completion_ids=request["completion_ids"], **columns
            )
            result["rewards"][spec.name] = {"scores": scores}
        except BaseException as error:  # SystemExit and KeyboardInterrupt from user code are errors too
            entry: RewardOutcome = {"error": _explain(error)[:2000]}
            frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == f"<reward {spec.name}>"]
            if frames:  # where in the user's code it was raised: what to fix
                entry["error"] += f" (line {frames[-1].lineno} of the reward)"
            index = getattr(error, "index", None)  # the row a built-in reward was scoring
            if index is not None:
                entry["row"] = index
            result["rewards"][spec.name] = entry
    sys.stdout.flush()
    with open(result_path, "w") as handle:
        json.dump(result, handle)


def _load_schema_builder() -> None:
    """Build one tool schema before the audit hook: transformers loads what it needs (ctypes among it) on first use,
    which the hook would then refuse as if the user's tool had asked for it."""
    from transformers.utils import get_json_schema

    def probe(text: str) -> str:
        """Probe.

        Args:
            text: any text
        """
        return text

    get_json_schema(probe)


def _rehearse_environment(request: "Request") -> "EnvironmentResult":
    """The user's environment checked and tried on the sample rows (jobs/environments/loading.py), written to and
    imported from the scratch folder."""
    from pathlib import Path

    from jobs.contract import EnvironmentSpec
    from jobs.environments.loading import rehearse, trainer_arguments

    try:
        arguments = trainer_arguments(EnvironmentSpec.model_validate(request["environment"]), Path.cwd())
        return {"calls": rehearse(arguments, request["rows"])}
    except BaseException as error:  # SystemExit and KeyboardInterrupt from user code are errors too
        return {"error": str(error) if isinstance(error, ValueError) else _explain(error)[:2000]}


if __name__ == "__main__":
    main(*sys.argv[1:4])
