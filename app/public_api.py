"""The panel's deliberate API: the few endpoints a script may call, signed in and owner-scoped as the UI is.

Gradio publishes every event a page wires as an API endpoint unless told otherwise (the panel had 133, most named
after a lambda). `make_private` turns every UI event private; `PublicApi.register` then adds these, public on
purpose and documented in the README (`gradio_client` example there):

    /list_runs          the caller's runs: id, name, status, step, latest reward, current version
    /launch_run         check a spec JSON as "Check settings" does, then create and launch it
    /run_status         one run's status, progress, versions and job states
    /run_metrics        one metric's (step, value) points, a page at a time
    /run_samples        rollout samples, newest step first, a page at a time
    /list_versions      the run's adapter versions with step, reward and audit verdict
    /download_version   a zip of one version (PeftModel.from_pretrained loads it unzipped)
    /evaluate_versions  score versions on the run's held-out prompts (kept in its bucket; asked again, read back)
    /stop_run           ask the run to stop (the trainer checkpoints, publishes and stops its replicas)

Who calls: on this machine the single local owner; in a Space the signed-in user of the browser session, or, for a
script, the Hugging Face user whose token it presents (`Client(space, token=...)` sends it as a bearer token in
X-HF-Authorization; the panel asks the Hub who it belongs to, once per token). Every call then goes through the
owner's services, so another owner's run is "not found", as in the UI.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeAlias, TypeVar

import gradio as gr
from cachetools import TTLCache
from gradio.data_classes import FileData
from gradio.events import api as api_endpoint  # gradio's __all__ leaves `gr.api` out

from app.panel import Panel, SignInRequired
from backend.api import PanelServices
from backend.credentials.vault import RunCredentials
from backend.database.models import AdapterVersion, RolloutSample, Run
from backend.launch.limits import LimitReached
from backend.services.runs import RunStateError

PUBLIC_ENDPOINTS = (
    "list_runs",
    "launch_run",
    "run_status",
    "run_metrics",
    "run_samples",
    "list_versions",
    "download_version",
    "evaluate_versions",
    "stop_run",
)
MAX_PAGE = 1000  # points or samples one call returns at most
TOKEN_CACHE_SIZE = 1024  # callers whose Hub user is remembered
TOKEN_CACHE_SECONDS = 300.0  # how long a token's user is trusted before the Hub is asked again

JsonObject: TypeAlias = dict[str, Any]
"""An endpoint's answer: plain data that Gradio sends to the caller as a JSON object."""
T = TypeVar("T")


def make_private(app: gr.Blocks) -> None:
    """Every event registered so far (the pages' wiring) stays callable by the page, but is no API endpoint: hidden
    from the API page and from `gradio_client`. Call it inside the Blocks context, before `PublicApi.register`."""
    for dependency in app.fns.values():
        dependency.api_visibility = "private"


class PublicApi:
    def __init__(self, panel: Panel):
        self.panel = panel
        # sha256 of a presented token -> its Hub user. Bounded, so callers cannot grow it without end, and expiring, so
        # a token revoked on the Hub stops working here within minutes.
        self._users: TTLCache[str, str] = TTLCache(maxsize=TOKEN_CACHE_SIZE, ttl=TOKEN_CACHE_SECONDS)
        self._lock = threading.Lock()

    def register(self) -> None:
        """Add the public endpoints to the Blocks being built (see the module's docstring)."""
        for name in PUBLIC_ENDPOINTS:
            api_endpoint(getattr(self, name), api_name=name)

    # --- who is calling ---------------------------------------------------------------------------------------------

    def _services(self, request: gr.Request | None, profile: gr.OAuthProfile | None) -> PanelServices:
        owner = self.panel.owner(profile) or self._token_owner(request)
        if owner is None:
            raise SignInRequired()
        return PanelServices(self.panel.ctx, owner)

    def _token_owner(self, request: gr.Request | None) -> str | None:
        """In a Space, the Hub user a script's bearer token belongs to (None without one; an error for a bad one)."""
        # gradio_client sends its token as X-HF-Authorization (a Space's proxy keeps Authorization for itself).
        headers = request.headers if request is not None else {}
        header = headers.get("x-hf-authorization") or headers.get("authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        key = hashlib.sha256(token.strip().encode()).hexdigest()
        with self._lock:
            user = self._users.get(key)
        if user is not None:
            return user
        from huggingface_hub import HfApi

        try:
            owner: str = HfApi(endpoint=self.panel.ctx.hub_endpoint).whoami(token=token.strip())["name"]
        except Exception as error:
            raise gr.Error(
                f"The Hugging Face token this call presented was refused by the Hub ({type(error).__name__}); pass "
                "a valid token: Client(space, token=...)"
            ) from None
        with self._lock:
            self._users[key] = owner
        return owner

    # --- the endpoints ------------------------------------------------------------------------------------------------

    def list_runs(self, request: gr.Request | None = None, profile: gr.OAuthProfile | None = None) -> list[JsonObject]:
        """The caller's runs, newest first: id, name, status, step, max_steps, latest reward, current version."""
        return [_run(run) for run in self._services(request, profile).runs.list()]

    def launch_run(
        self,
        spec_json: str,
        store_credential_id: int | None = None,
        hf_credential_id: int | None = None,
        wandb_credential_id: int | None = None,
        request: gr.Request | None = None,
        profile: gr.OAuthProfile | None = None,
    ) -> JsonObject:
        """Check a run spec (JSON, as `python -m backend plan --spec` reads it) as "Check settings" does, then
        create and launch it. Credentials are the ids the Account and Launch pages list for the caller. A spec that
        fails a check launches nothing; the error names each field and its fix."""
        services = self._services(request, profile)
        try:
            data = json.loads(spec_json)
        except json.JSONDecodeError as error:
            raise gr.Error(f"spec_json: not JSON ({error.msg} at character {error.pos})") from None
        chosen = RunCredentials(store_credential_id, hf_credential_id, wandb_credential_id)
        result = _found(lambda: services.preflight(data, *chosen))
        spec = result.checked_spec
        if spec is None:
            problems = "; ".join(f"{field}: {message}" for field, message in result.errors.items())
            raise gr.Error(f"Not launched: {problems}")
        run = _found(lambda: services.runs.create(spec, *chosen))
        _found(lambda: services.runs.launch(run.id))
        return _run(services.runs.get(run.id))

    def run_status(
        self, run_id: str, request: gr.Request | None = None, profile: gr.OAuthProfile | None = None
    ) -> JsonObject:
        """One run: status and why, step of max_steps, reward, versions (current and best), and each job's state."""
        services = self._services(request, profile)
        run = _found(lambda: services.runs.get(run_id))
        jobs = [{"role": job.role, "attempt": job.attempt, "stage": job.stage} for job in services.runs.jobs(run_id)]
        return {**_run(run), "best_version": run.best_version, "jobs": jobs}

    def run_metrics(
        self,
        run_id: str,
        name: str = "reward",
        offset: int = 0,
        limit: int = MAX_PAGE,
        request: gr.Request | None = None,
        profile: gr.OAuthProfile | None = None,
    ) -> JsonObject:
        """The metric's [step, value] points in step order, `limit` (at most 1000) from `offset`; `names` lists the
        run's metrics (TRL's names), `next_offset` is null on the last page."""
        queries = self._services(request, profile).queries
        points = _found(lambda: queries.metric_series(run_id, name, max_points=None))
        page, following = _page(points, offset, limit)
        names = queries.metric_names(run_id)
        return {"name": name, "points": [list(p) for p in page], "next_offset": following, "names": names}

    def run_samples(
        self,
        run_id: str,
        offset: int = 0,
        limit: int = 50,
        request: gr.Request | None = None,
        profile: gr.OAuthProfile | None = None,
    ) -> JsonObject:
        """Rollout samples newest step first (prompt, completion, reward, per-reward scores, advantage, policy
        version, staleness; an agent's episode turn by turn in `turns`, null for a single reply), `limit` (at most
        1000) from `offset`; `next_offset` is null on the last page."""
        queries = self._services(request, profile).queries
        limit = max(1, min(limit, MAX_PAGE))
        rows = _found(lambda: queries.samples(run_id, limit=limit + 1, offset=max(0, offset)))
        samples = [_sample(row) for row in rows[:limit]]
        return {"samples": samples, "next_offset": offset + limit if len(rows) > limit else None}

    def list_versions(
        self, run_id: str, request: gr.Request | None = None, profile: gr.OAuthProfile | None = None
    ) -> list[JsonObject]:
        """The run's adapter versions: version, step, reward near that step, size, and the policy audit's verdict."""
        adapters = self._services(request, profile).adapters
        return [_version(v) for v in _found(lambda: adapters.versions(run_id))]

    def download_version(
        self, run_id: str, version: int, request: gr.Request | None = None, profile: gr.OAuthProfile | None = None
    ) -> FileData:
        """A zip of one adapter version, verified against its manifest; unzip and `PeftModel.from_pretrained` it."""
        adapters = self._services(request, profile).adapters
        return FileData(path=str(_found(lambda: adapters.download_zip(run_id, version))))

    def evaluate_versions(
        self,
        run_id: str,
        versions: str = "0 last",
        request: gr.Request | None = None,
        profile: gr.OAuthProfile | None = None,
    ) -> JsonObject:
        """Score versions on the run's held-out prompts (never trained on), as `python -m backend eval` does:
        `versions` holds numbers (0: the base model), `last`, `all`, `every:N` (every Nth version and the last) or
        `best-reward` (the highest training reward), separated by spaces. Per version, each score's mean with its
        95 % interval; for two versions, their difference prompt by prompt. Results are kept in the run's bucket:
        asked again, they are read back."""
        evaluation = self._services(request, profile).evaluation
        numbers = _found(lambda: evaluation.versions_named(run_id, versions.split()))
        return evaluation.report(_found(lambda: evaluation.evaluate(run_id, numbers)))

    def stop_run(
        self, run_id: str, request: gr.Request | None = None, profile: gr.OAuthProfile | None = None
    ) -> JsonObject:
        """Ask the run to stop: the trainer checkpoints, publishes its last version and stops its replicas."""
        runs = self._services(request, profile).runs
        return _run(_found(lambda: runs.stop(run_id, reason="stopped through the API")))


def _found(call: Callable[[], T]) -> T:
    """The call's result; a run or version the caller does not own or that does not exist is one clear error."""
    try:
        return call()
    except (LookupError, PermissionError, ValueError, RunStateError, LimitReached) as error:
        raise gr.Error(str(error)) from None


def _page(items: list[T], offset: int, limit: int) -> tuple[list[T], int | None]:
    offset, limit = max(0, offset), max(1, min(limit, MAX_PAGE))
    following = offset + limit if offset + limit < len(items) else None
    return items[offset : offset + limit], following


def _pick(row: object, *columns: str, **renamed: str) -> JsonObject:
    """A database row's `columns` as a JSON object, and `renamed` ones under the API's name (api name -> column)."""
    named = {column: column for column in columns} | renamed
    return {name: getattr(row, column) for name, column in named.items()}


def _run(run: Run) -> JsonObject:
    return _pick(run, "name", "status", "step", "max_steps", "latest_reward", "current_version", "created_at",
                 run_id="id", message="status_message")  # fmt: skip


def _version(row: AdapterVersion) -> JsonObject:
    return _pick(row, "version", "step", "reward", "size_bytes", "audit_ok", "audit_max_diff")


def _sample(row: RolloutSample) -> JsonObject:
    columns = ("step", "policy_version", "staleness", "group_id", "prompt", "completion", "reward", "advantage")
    turns = row.turns
    return {
        **_pick(row, *columns, "dropped"),
        "rewards": row.rewards,
        "turns": None if turns is None else [asdict(turn) for turn in turns],
    }
