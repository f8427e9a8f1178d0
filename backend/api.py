"""The one object the UI holds per signed-in owner: every backend service, scoped to that owner.

services = PanelServices(ctx, owner="alice")
services.preflight(spec_dict, store_credential_id=..., hf_credential_id=...)
services.runs.create(spec, ...); services.runs.launch(run_id)
services.queries.metric_series(run_id, "reward")
services.adapters.download_zip(run_id, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend.context import PanelContext
from backend.credentials.hub_tokens import HubIdentity, check_hf_token
from backend.database.models import Run
from backend.launch.preflight import Preflight, run_preflight
from backend.sandbox.client import RewardTrial, SandboxLimits, run_rewards
from backend.services.adapters import AdapterService
from backend.services.evaluation import EvaluationService
from backend.services.exports import ExportService
from backend.services.queries import QueryService
from backend.services.runs import RunService, run_row
from backend.services.smoke import SmokeReport, SmokeTest
from jobs.contract import RewardSpec, RunSpec, layout, parse_storage_uri
from jobs.smoke import Step
from jobs.store import StoreAccessError, open_store


class PanelServices:
    def __init__(self, ctx: PanelContext, owner: str):
        self.ctx, self.owner = ctx, owner
        self.runs = RunService(ctx, owner)
        self.queries = QueryService(ctx, owner)
        self.adapters = AdapterService(ctx, owner)
        self.evaluation = EvaluationService(ctx, owner)
        self.exports = ExportService(ctx, owner)
        self.credentials = ctx.vault

    def check_hf_token(self, token: str) -> HubIdentity | None:
        """Who the Hub says the token is (None: the Hub could not be reached); raises TokenRefused if refused."""
        return check_hf_token(token, self.ctx.hub_endpoint)

    def preflight(
        self,
        data: dict[str, Any] | RunSpec,
        store_credential_id: int | None = None,
        hf_credential_id: int | None = None,
        wandb_credential_id: int | None = None,
    ) -> Preflight:
        with self.ctx.limits.checking(self.owner):
            return run_preflight(
                self.ctx,
                self.owner,
                data,
                store_credential_id,
                hf_credential_id,
                wandb_credential_id=wandb_credential_id,
            )

    def test_rewards(
        self, rewards: list[RewardSpec], rows: list[dict[str, Any]], completions: list[str] | None = None
    ) -> list[RewardTrial]:
        """Run rewards on sample rows in the sandbox (completions default to each row's gold answer)."""
        completions = completions if completions is not None else [str(r.get("answer") or "") for r in rows]
        self.ctx.limits.count_reward_tests(self.owner, 1)
        return run_rewards(rewards, rows, completions, SandboxLimits())

    def flavor_prices(self, hf_credential_id: int) -> dict[str, float]:
        """$/hour of every HF Jobs flavor, as the Hub lists them for this owner's token (cached per token)."""
        self.ctx.vault.get(self.owner, hf_credential_id)  # raises unless this owner holds the credential
        return self.ctx.hf_launcher(self.owner, hf_credential_id).prices_per_hour()

    def smoke_test(
        self,
        spec: RunSpec,
        store_credential_id: int | None,
        hf_credential_id: int | None,
        on_step: Callable[[Step], None] = lambda step: None,
    ) -> SmokeReport:
        """One cpu-basic job on HF Jobs proving the bucket, the code bundle and the job's URL (services/smoke.py)."""
        with self.ctx.limits.checking(self.owner, "smoke test"):
            return SmokeTest(self.ctx, self.owner, on_step).run(spec, store_credential_id, hf_credential_id)

    def test_connection(
        self, uri: str, endpoint: str | None, region: str | None, store_credential_id: int | None
    ) -> str:
        """Probe a bucket with the owner's credentials; returns a description, raises StoreAccessError."""
        location = parse_storage_uri(uri, endpoint=endpoint, region=region)
        credentials = None
        if store_credential_id is not None:
            credentials = self.ctx.vault.store_credentials(self.owner, store_credential_id)
        elif location.kind == "s3":
            raise StoreAccessError(f"{location.describe()}: enter an access key and secret first")
        store = open_store(location, credentials)
        store.probe()
        return store.describe()

    def import_bucket(
        self, uri: str, endpoint: str | None = None, region: str | None = None, store_credential_id: int | None = None
    ) -> list[str]:
        """Add the runs a bucket holds but the panel does not know, and ingest what they wrote. Returns their ids."""
        from backend.ingestion.poller import Poller

        location = parse_storage_uri(uri, endpoint=endpoint, region=region)
        credentials = self.ctx.vault.store_credentials(self.owner, store_credential_id) if store_credential_id else None
        store = open_store(location, credentials)
        imported = []
        for run_id in store.list_dirs(layout.RUNS + "/"):
            try:
                spec = RunSpec.from_json(store.get_bytes(layout.spec_key(run_id)))
            except Exception:
                continue  # not a run folder, or a spec this version cannot read
            with self.ctx.db.session() as session:
                if session.get(Run, spec.run_id) is not None:
                    continue
                session.add(
                    run_row(spec, self.owner, "running", store_credential_id, message="imported from the bucket")
                )
                session.commit()
            poller = Poller(self.ctx)
            while poller.poll_run(spec.run_id):  # a long run takes several passes
                pass
            imported.append(spec.run_id)
        return imported
