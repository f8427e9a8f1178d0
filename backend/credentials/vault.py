"""Credentials: entered once, encrypted at rest, shown masked, handed to launchers as secrets only.

The encryption key comes from `$GRPO_PANEL_KEY` (a Fernet key; set it as a Space secret), or is generated once into
the data folder with 0600 permissions. A credential is only ever decrypted to build a store client or a job's secret
environment; the UI sees `masked`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import NamedTuple

from cryptography.fernet import Fernet, InvalidToken
from sqlmodel import Session, select

from backend import settings
from backend.database.connection import Database, data_dir
from backend.database.models import Credential
from jobs.secrets import register_secret
from jobs.store import StoreCredentials

KINDS = ("hf_token", "s3", "wandb")


class CredentialError(ValueError):
    pass


class RunCredentials(NamedTuple):
    """The credential ids a run is made with (None: none of that kind), in the order preflight and `runs.create`
    take them."""

    store: int | None = None
    hf: int | None = None
    wandb: int | None = None


def load_key(folder: Path | None = None) -> bytes:
    key = settings.KEY.get()
    if key:
        return key.encode()
    path = (folder or data_dir()) / "secret.key"
    if not path.exists():
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(Fernet.generate_key())
    return path.read_bytes().strip()


def mask(value: str) -> str:
    """Enough to recognise a secret, not enough to use it: 'hf_…x3Fq'."""
    value = value.strip()
    if len(value) <= 8:
        return "•" * len(value)
    head = value[:3] if value.startswith(("hf_", "AKI", "HFA")) else ""
    return f"{head}…{value[-4:]}"


class Vault:
    def __init__(self, db: Database, key: bytes | None = None):
        self.db = db
        self.fernet = Fernet(key or load_key(db.path.parent))

    def save(self, owner: str, name: str, kind: str, value: str | dict[str, str]) -> Credential:
        """Store (or replace) a credential. `value` is a token, or {access_key_id, secret_access_key} for s3."""
        if kind not in KINDS:
            raise CredentialError(f"kind must be one of {', '.join(KINDS)}")
        if kind == "s3":
            if not isinstance(value, dict) or not value.get("access_key_id") or not value.get("secret_access_key"):
                raise CredentialError("bucket credentials need an access key id and a secret access key")
            plain, shown = (
                json.dumps({k: value[k].strip() for k in ("access_key_id", "secret_access_key")}),
                (f"{mask(value['access_key_id'])} / {mask(value['secret_access_key'])}"),
            )
        else:
            if not isinstance(value, str) or not value.strip():
                raise CredentialError("the token is empty")
            plain, shown = value.strip(), mask(value)
        with self.db.session() as session:
            existing = session.exec(
                select(Credential).where(Credential.owner == owner, Credential.name == name)
            ).first()
            credential = existing or Credential(
                owner=owner, name=name, kind=kind, ciphertext=b"", masked="", created_at=time.time()
            )
            credential.kind, credential.masked = kind, shown
            credential.ciphertext = self.fernet.encrypt(plain.encode())
            session.add(credential)
            session.commit()
            session.refresh(credential)
            return credential

    def list(self, owner: str) -> list[Credential]:
        with self.db.session() as session:
            return list(session.exec(select(Credential).where(Credential.owner == owner)).all())

    def get(self, owner: str, credential_id: int) -> Credential:
        """The credential's metadata (name, kind, masked value) if `owner` holds it."""
        with self.db.session() as session:
            return self._get(session, owner, credential_id)

    def delete(self, owner: str, credential_id: int) -> None:
        with self.db.session() as session:
            credential = self._get(session, owner, credential_id)
            session.delete(credential)
            session.commit()

    def _get(self, session: Session, owner: str, credential_id: int) -> Credential:
        credential = session.get(Credential, credential_id)
        if credential is None or credential.owner != owner:
            raise CredentialError(f"no credential {credential_id} for this account")
        return credential

    def _reveal(self, owner: str, credential_id: int, kind: str) -> str:
        with self.db.session() as session:
            credential = self._get(session, owner, credential_id)
        if credential.kind != kind:
            raise CredentialError(f"credential {credential.name!r} is a {credential.kind}, not a {kind}")
        try:
            plain = self.fernet.decrypt(credential.ciphertext).decode()
        except InvalidToken:
            raise CredentialError(
                f"credential {credential.name!r} cannot be decrypted with this panel's key ({settings.KEY.name}); "
                "enter it again"
            ) from None
        return plain

    def encrypt(self, value: str) -> bytes:
        return self.fernet.encrypt(value.encode())

    def decrypt(self, ciphertext: bytes) -> str:
        value = self.fernet.decrypt(ciphertext).decode()
        register_secret(value)
        return value

    def hf_token(self, owner: str, credential_id: int) -> str:
        token = self._reveal(owner, credential_id, "hf_token")
        register_secret(token)
        return token

    def wandb_key(self, owner: str, credential_id: int) -> str:
        key = self._reveal(owner, credential_id, "wandb")
        register_secret(key)
        return key

    def store_credentials(self, owner: str, credential_id: int) -> StoreCredentials:
        body = json.loads(self._reveal(owner, credential_id, "s3"))
        register_secret(body["secret_access_key"])
        register_secret(body["access_key_id"])
        return StoreCredentials(body["access_key_id"], body["secret_access_key"])
