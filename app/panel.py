"""Who is asking, and the services scoped to them.

The owner always comes from the session — the signed-in Hugging Face user in a Space, the single local owner on this
machine — and never from a form field, so no page can be talked into showing or changing another owner's runs.
"""

from __future__ import annotations

import gradio as gr

from backend.api import PanelServices
from backend.context import PanelContext
from backend.database.models import Credential

LOCAL_OWNER = "local"
OAUTH_CREDENTIAL = "Hugging Face sign-in"


class SignInRequired(gr.Error):
    def __init__(self) -> None:
        super().__init__("Sign in with Hugging Face first (Account tab): runs belong to the signed-in user.")


class Panel:
    def __init__(self, ctx: PanelContext, space: bool):
        self.ctx, self.space = ctx, space

    def owner(self, profile: gr.OAuthProfile | None) -> str | None:
        """The session's owner; None in a Space before sign-in."""
        if not self.space:
            return LOCAL_OWNER
        return profile.username if profile is not None else None

    def services(self, profile: gr.OAuthProfile | None) -> PanelServices:
        """Services for the session's owner; raises (shown as a toast) when nobody is signed in."""
        owner = self.owner(profile)
        if owner is None:
            raise SignInRequired()
        return PanelServices(self.ctx, owner)

    def services_or_none(self, profile: gr.OAuthProfile | None) -> PanelServices | None:
        """For refreshes: a page shows its signed-out empty state instead of raising on every tick."""
        owner = self.owner(profile)
        return PanelServices(self.ctx, owner) if owner is not None else None

    def remember_oauth_token(self, profile: gr.OAuthProfile | None, token: gr.OAuthToken | None) -> Credential | None:
        """In a Space, keep the signed-in user's OAuth token in the vault, so their runs can start Jobs as them."""
        owner = self.owner(profile)
        if not self.space or owner is None or token is None:
            return None
        return self.ctx.vault.save(owner, OAUTH_CREDENTIAL, "hf_token", token.token)
