"""Asking the Hub who a token belongs to before the panel keeps it.

A token the Hub refuses would only fail later, at launch or publish time, far from where it was typed; a token
that works is shown with its user and what it may do, so a read-only token is noticed before a publish needs write
access. Without a reachable Hub (this machine offline) a token that looks like one is kept unchecked, and the
panel says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOKEN_PREFIX = "hf_"  # user access tokens and OAuth tokens alike


class TokenRefused(ValueError):
    """The value is not a token the Hub accepts; the message says what to do."""


@dataclass(frozen=True)
class HubIdentity:
    user: str
    access: str  # "read", "write", or the fine-grained permissions

    def describe(self) -> str:
        return f"user {self.user}, {self.access}"


def check_hf_token(token: str, endpoint: str | None) -> HubIdentity | None:
    """Who the Hub says `token` is; None if the Hub could not be reached. Raises TokenRefused otherwise."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise TokenRefused(
            f"This is not a Hugging Face token (they start with {TOKEN_PREFIX!r}): create one at "
            "https://huggingface.co/settings/tokens and paste it whole."
        )
    try:
        answer = HfApi(endpoint=endpoint).whoami(token=token)
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            raise TokenRefused(
                "The Hub refused this token (it may be revoked, expired or mistyped): create a new one at "
                "https://huggingface.co/settings/tokens."
            ) from None
        return None  # the Hub answered with an error of its own: keep the token, unchecked
    except (OSError, httpx2.TransportError):  # no route to the Hub: connection refused, DNS, timeout
        return None
    return HubIdentity(str(answer.get("name", "?")), _access(answer.get("auth") or {}))


def _access(auth: dict[str, Any]) -> str:
    """What a token may do, from whoami's `auth.accessToken`: its role, or a fine-grained token's permissions."""
    token = auth.get("accessToken") or {}
    role = token.get("role")
    if role == "fineGrained":
        granted = token.get("fineGrained") or {}
        permissions = sorted(
            {p for scope in granted.get("scoped") or [] for p in scope.get("permissions") or []}
            | set(granted.get("global") or [])
        )
        return "fine-grained: " + (", ".join(permissions) or "no permissions")
    return f"{role} access" if role else "access unknown"
