"""Credentials: encrypted at rest, masked when shown, owner-scoped, key kept private."""

from __future__ import annotations

import os
import stat

import pytest
from cryptography.fernet import Fernet

from backend.credentials.vault import CredentialError, Vault, mask
from backend.database.connection import Database

HF = "hf_abcdefghijklmnopqrstuvwxyz012345"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def vault(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_PANEL_KEY", raising=False)
    db = Database(tmp_path / "panel.sqlite3")
    yield Vault(db)
    db.close()


def test_secrets_are_encrypted_at_rest_and_masked(vault, tmp_path):
    token = vault.save("alice", "hub", "hf_token", HF)
    keys = vault.save("alice", "bucket", "s3", {"access_key_id": "AKIAIOSFODNN7EXAMPLE", "secret_access_key": SECRET})
    raw = (tmp_path / "panel.sqlite3").read_bytes() + b"".join(
        p.read_bytes() for p in tmp_path.glob("panel.sqlite3-*") if p.is_file()
    )
    assert HF.encode() not in raw and SECRET.encode() not in raw and b"AKIAIOSFODNN7EXAMPLE" not in raw
    assert token.masked == "hf_…2345" and HF not in keys.masked and SECRET not in keys.masked
    assert vault.hf_token("alice", token.id) == HF
    credentials = vault.store_credentials("alice", keys.id)
    assert (credentials.access_key_id, credentials.secret_access_key) == ("AKIAIOSFODNN7EXAMPLE", SECRET)
    assert SECRET not in repr(credentials)


def test_generated_key_is_private(vault, tmp_path):
    key_file = tmp_path / "secret.key"
    assert key_file.exists()
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600


def test_key_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_PANEL_KEY", Fernet.generate_key().decode())
    db = Database(tmp_path / "p.sqlite3")
    vault = Vault(db)
    saved = vault.save("bob", "hub", "hf_token", HF)
    assert not (tmp_path / "secret.key").exists()
    monkeypatch.setenv("GRPO_PANEL_KEY", Fernet.generate_key().decode())  # a different key cannot read it
    with pytest.raises(CredentialError, match="cannot be decrypted"):
        Vault(db).hf_token("bob", saved.id)
    db.close()


def test_owners_cannot_use_each_others_credentials(vault):
    saved = vault.save("alice", "hub", "hf_token", HF)
    with pytest.raises(CredentialError, match="no credential"):
        vault.hf_token("mallory", saved.id)
    with pytest.raises(CredentialError):
        vault.delete("mallory", saved.id)
    assert vault.list("mallory") == []
    assert [c.name for c in vault.list("alice")] == ["hub"]


def test_bad_input(vault):
    with pytest.raises(CredentialError):
        vault.save("alice", "x", "password", "y")
    with pytest.raises(CredentialError):
        vault.save("alice", "x", "s3", {"access_key_id": "a"})
    with pytest.raises(CredentialError):
        vault.save("alice", "x", "hf_token", "  ")
    saved = vault.save("alice", "b", "s3", {"access_key_id": "AKIAIOSFODNN7EXAMPLE", "secret_access_key": SECRET})
    with pytest.raises(CredentialError, match="not a hf_token"):
        vault.hf_token("alice", saved.id)


def test_mask():
    assert mask("short") == "•••••"
    assert mask(HF).startswith("hf_…") and mask(HF).endswith(HF[-4:])
