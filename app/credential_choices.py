"""Saved credentials as dropdown choices: the name and the masked value, never the secret."""

from __future__ import annotations

from backend.api import PanelServices

NONE = ""


def credential_choices(services: PanelServices | None, kind: str, none_label: str) -> list[tuple[str, str]]:
    choices = [(none_label, NONE)]
    if services is None:
        return choices
    for credential in services.credentials.list(services.owner):
        if credential.kind == kind:
            choices.append((f"{credential.name} · {credential.masked}", str(credential.id)))
    return choices
