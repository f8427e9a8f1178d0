"""What the services and the poller share: the database, the credential vault, stores and launchers per run."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from backend import settings
from backend.credentials.vault import Vault
from backend.database.connection import Database, data_dir
from backend.database.models import Job, Run
from backend.launch.limits import OwnerLimiter
from backend.launch.plan import RunPlan
from backend.launchers.base import JobHandle, Launcher, RunSecrets
from backend.launchers.local import LocalLauncher
from jobs.contract import RunSpec
from jobs.store import ObjectStore, StoreCredentials, open_store

if TYPE_CHECKING:  # imported where it is used, so that loading this module does not load huggingface_hub
    from backend.launchers.hf_jobs import HfJobsLauncher

UNSET = "<not entered yet>"  # stands for a credential in a plan printed before it was entered


class PanelContext:
    def __init__(self, db: Database | None = None, folder: Path | None = None, hub_endpoint: str | None = None):
        self.db = db or Database()
        # The Hub the HF Jobs launcher talks to: huggingface.co unless HF_ENDPOINT (or this argument) says otherwise.
        self.hub_endpoint = hub_endpoint or settings.HF_ENDPOINT.get()
        self.folder = Path(folder or data_dir())
        self.vault = Vault(self.db)
        self.limits = OwnerLimiter()  # per-owner limits on runs, checks and reward tests (backend/launch/limits.py)
        self.local_launcher = LocalLauncher(self.folder / "jobs")
        self._hf_launchers: dict[tuple[str, int | None], HfJobsLauncher] = {}
        self._stores: dict[str, ObjectStore] = {}
        self._lock = threading.Lock()

    def spec(self, run: Run) -> RunSpec:
        return RunSpec.from_json(run.spec_json)

    def fresh_store(self, run: Run) -> ObjectStore:
        """The run's store, opened with the run's own bucket credentials (never the panel's environment)."""
        credentials = (
            self.vault.store_credentials(run.owner, run.store_credential_id)
            if run.store_credential_id is not None
            else None
        )
        spec = self.spec(run)
        if credentials is None and spec.storage.uri.startswith(("s3://", "hf://")):
            raise ValueError("this run's bucket has no credentials; add an access key and secret")
        return open_store(spec.storage, credentials)

    def store_for(self, run: Run) -> ObjectStore:
        """`fresh_store`, cached per run."""
        with self._lock:
            if run.id not in self._stores:
                self._stores[run.id] = self.fresh_store(run)
            return self._stores[run.id]

    def secrets_for(self, run: Run) -> RunSecrets:
        """The run's secrets, with the replica token its jobs share (a local run's is created and kept on first use)."""
        secrets = self._credentials(run)
        if run.backend == "hf_jobs" and secrets.hf_token:
            secrets.replica_token = secrets.hf_token  # HF Jobs checks the HF token in front of every exposed port
        else:
            secrets.replica_token = self._replica_token(run.id, secrets.replica_token)
        return secrets

    def _credentials(self, run: Run) -> RunSecrets:
        """The run's HF token, bucket keys and W&B key (only if it reports to W&B) from the vault, with a fresh
        replica token that nothing keeps."""
        hf_token = self.vault.hf_token(run.owner, run.hf_credential_id) if run.hf_credential_id is not None else None
        wandb_id = run.wandb_credential_id  # only a run that reports to W&B gets its key
        wandb_key = (
            self.vault.wandb_key(run.owner, wandb_id)
            if wandb_id is not None and self.spec(run).reporting.wandb
            else None
        )
        store = (
            self.vault.store_credentials(run.owner, run.store_credential_id)
            if run.store_credential_id is not None
            else None
        )
        return RunSecrets(hf_token=hf_token, store=store, wandb_key=wandb_key)

    def _replica_token(self, run_id: str, fresh: str) -> str:
        """The run's local replica token: the one stored for it, or `fresh`, stored now (encrypted)."""
        with self.db.session() as session:
            row = session.get(Run, run_id)
            if row is None:
                return fresh
            if row.replica_token_ciphertext is None:
                row.replica_token_ciphertext = self.vault.encrypt(fresh)
                session.add(row)
                session.commit()
                return fresh
            return self.vault.decrypt(row.replica_token_ciphertext)

    def launcher_for(self, run: Run) -> Launcher:
        if run.backend == "local":
            return self.local_launcher
        return self.hf_launcher(run.owner, run.hf_credential_id)

    def hf_launcher(self, owner: str, hf_credential_id: int | None) -> HfJobsLauncher:
        """The HF Jobs launcher acting with this HF token of `owner`'s, cached per token."""
        from backend.launchers.hf_jobs import HfJobsLauncher

        key = (owner, hf_credential_id)
        with self._lock:
            if key not in self._hf_launchers:
                if hf_credential_id is None:
                    raise ValueError("this run has no HF token; add one in the credentials form")
                token = self.vault.hf_token(owner, hf_credential_id)
                self._hf_launchers[key] = HfJobsLauncher(token, endpoint=self.hub_endpoint)
            return self._hf_launchers[key]

    def plan(self, run: Run, parameters: int | None = None) -> RunPlan:
        """Every job launching `run` submits (see backend/launch/plan.py).

        With the run's credentials the plan names exactly the secrets a launch sends. Without them (a plan printed
        before any were entered) it names the ones a launch of this spec needs; a plan never holds a secret's value.
        A plan is a dry run: it writes nothing (not even the replica token a launch would keep). `parameters`, the
        model's size where preflight read it, resolves an "auto" sharding.
        """
        spec = self.spec(run)
        secrets = self._credentials(run)
        if spec.reporting.wandb:
            secrets.wandb_key = secrets.wandb_key or UNSET
        if run.backend == "local":
            return self.local_launcher.plan(spec, secrets, parameters)
        from backend.launchers.hf_jobs import HfJobsLauncher

        launcher = (
            self.hf_launcher(run.owner, run.hf_credential_id)
            if run.hf_credential_id is not None
            else HfJobsLauncher(None, self.hub_endpoint)
        )
        secrets.hf_token = secrets.hf_token or UNSET
        if secrets.store is None and not spec.storage.uri.startswith("file://"):
            secrets.store = StoreCredentials(UNSET, UNSET)
        return launcher.plan(spec, secrets, parameters)

    @staticmethod
    def handle(job: Job) -> JobHandle:
        return JobHandle(
            run_id=job.run_id, role=job.role, job_id=job.backend_job_id, backend="", url=job.url, endpoint=job.endpoint
        )
