"""A panel pointed at the Hub Jobs emulator, with moto S3 as the bucket: what the HF Jobs tests share."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.context import PanelContext
from backend.database.connection import Database
from tests.support.hub_emulator import HubEmulator
from tests.support.moto_s3 import MotoS3Server
from tests.support.tls import make_server_tls

TOKEN = "hf_emulatortoken0123456789abcdef"  # a made-up token the emulator accepts; valid nowhere else
OWNER = "tester"


def start_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubEmulator:
    """The emulator, running jobs with this interpreter and the tiny demo model's cache, its exposed ports behind an
    HTTPS edge whose CA the jobs and this process (through `monkeypatch`, for `requests`) trust."""
    (tmp_path / "edge-ca").mkdir(exist_ok=True)
    tls, ca_file = make_server_tls(tmp_path / "edge-ca")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca_file))
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path / "jobtmp"),
        "GRPO_MODEL_CACHE": os.environ.get("GRPO_MODEL_CACHE", str(Path.home() / ".cache/grpo-panel/models")),
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "SSL_CERT_FILE": str(ca_file),  # Python's ssl (the trainer's proxy client)
        "REQUESTS_CA_BUNDLE": str(ca_file),  # requests (the policy audit)
    }
    (tmp_path / "jobtmp").mkdir(exist_ok=True)
    hub = HubEmulator(tmp_path / "hub", tokens=(TOKEN,), namespace=OWNER, base_env=env, scheduling_delay=0.2, tls=tls)
    hub.base_env["HF_ENDPOINT"] = hub.url  # the trainer job cancels its replicas through the same (emulated) Hub
    return hub.start()


@dataclass
class HubPanel:
    ctx: PanelContext
    hf_credential_id: int
    store_credential_id: int
    bucket: str


def hub_panel(tmp_path: Path, emulator: HubEmulator, moto_server: MotoS3Server) -> HubPanel:
    """A panel whose owner holds an HF token for the emulator and keys for a fresh moto bucket."""
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path, hub_endpoint=emulator.url)
    hf = ctx.vault.save(OWNER, "hub", "hf_token", TOKEN)
    keys = ctx.vault.save(
        OWNER,
        "bucket",
        "s3",
        {
            "access_key_id": moto_server.credentials.access_key_id,
            "secret_access_key": moto_server.credentials.secret_access_key,
        },
    )
    return HubPanel(ctx, hf.id, keys.id, moto_server.create_bucket())
