"""Account: who you are to the panel, and the credentials it keeps for you (encrypted, shown masked).

In a Space you sign in with Hugging Face (the button in the page header) and see only your own runs; your sign-in
token is kept so your runs can start Jobs as you. On this machine there is one owner, and an HF token is optional
(for HF Jobs, gated models and publishing).
"""

from __future__ import annotations

from typing import cast

import gradio as gr
import pandas as pd

from app import cards
from app.events import Components, Updates
from app.formatting import clock
from app.panel import LOCAL_OWNER, Panel
from backend.credentials.hub_tokens import TokenRefused

COLUMNS = ["name", "kind", "value (masked)", "saved"]
KIND_LABELS = {"hf_token": "HF token", "s3": "bucket keys", "wandb": "W&B key"}
MIN_WANDB_KEY = 40  # W&B's keys are 40 characters (newer ones longer)


class AccountPage:
    def __init__(self, panel: Panel):
        self.panel = panel

    def build(self) -> None:
        self.who = gr.HTML("", elem_id="account-who", padding=False)
        gr.Markdown("### Credentials", elem_classes="gp-section-title")
        self.table = gr.Dataframe(
            pd.DataFrame(columns=COLUMNS),
            interactive=False,
            elem_id="credentials-table",
            label="Saved credentials (encrypted at rest; the panel never shows them again)",
        )
        self.token_name, self.token, self.save_button = _secret_row(
            "hf-token", "Hugging Face token (optional)", "hf_…  (stored encrypted, shown masked)", "Save token", "token"
        )
        self.wandb_name, self.wandb_key, self.save_wandb_button = _secret_row(
            "wandb",
            "Weights & Biases key (optional)",
            "from wandb.ai/authorize; only a run that reports to W&B gets it, as a Job secret",
            "Save W&B key",
            "wandb",
        )
        with gr.Row(elem_classes="gp-align-end"):
            self.delete_id = gr.Dropdown([], label="Credential", scale=3, elem_id="delete-credential")
            self.delete_button = gr.Button("Delete…", variant="stop", scale=1, elem_id="delete-credential-ask")
        with gr.Row(visible=False, elem_classes="gp-align-end") as self.confirm_row:
            self.confirm_text = gr.HTML("", padding=False)
            self.confirm_button = gr.Button("Yes, delete it", variant="stop", scale=0, elem_id="delete-credential-yes")
            self.cancel_button = gr.Button("Keep it", scale=0, elem_id="delete-credential-no")
        self.result = gr.HTML("", padding=False, elem_id="account-result")
        self.save_button.click(
            self.save_token, [self.token_name, self.token], [self.result, self.token, *self.refresh_outputs()]
        )
        self.save_wandb_button.click(
            self.save_wandb_key,
            [self.wandb_name, self.wandb_key],
            [self.result, self.wandb_key, *self.refresh_outputs()],
        )
        confirm = [self.confirm_row, self.confirm_text, self.result]
        self.delete_button.click(self.ask_delete, [self.delete_id], confirm)
        self.cancel_button.click(lambda: {self.confirm_row: gr.Row(visible=False)}, None, [self.confirm_row])
        self.confirm_button.click(self.delete, [self.delete_id], [*confirm, *self.refresh_outputs()])

    def refresh_outputs(self) -> Components:
        return [self.who, self.table, self.delete_id]

    def refresh(self, profile: gr.OAuthProfile | None = None, token: gr.OAuthToken | None = None) -> Updates:
        """On page load and after changes; in a Space this also keeps the sign-in token for the user's Jobs."""
        self.panel.remember_oauth_token(profile, token)
        services = self.panel.services_or_none(profile)
        if services is None:
            return {
                self.who: cards.note("Not signed in: sign in with Hugging Face to launch and see your runs.", "warn"),
                self.table: pd.DataFrame(columns=COLUMNS),
                self.delete_id: gr.Dropdown(choices=[], value=None),
            }
        if services.owner == LOCAL_OWNER:
            who = cards.note(
                "This machine has a single owner, “local”: every run here is yours. Add an HF token "
                "below only if you use HF Jobs, gated models or publishing."
            )
        else:
            who = cards.note(f"Signed in as {services.owner}: you see only your own runs.", "good")
        saved = services.credentials.list(services.owner)
        table = pd.DataFrame(
            [
                [
                    c.name,
                    KIND_LABELS.get(c.kind, c.kind),
                    c.masked,
                    clock(c.created_at),
                ]
                for c in saved
            ],
            columns=COLUMNS,
        )
        if not saved:
            table = pd.DataFrame([["No credentials saved yet", "", "", ""]], columns=COLUMNS)
        choices = [(f"{c.name} · {c.masked}", cast(int, c.id)) for c in saved]  # saved rows have their id
        return {self.who: who, self.table: table, self.delete_id: gr.Dropdown(choices=choices, value=None)}

    def save_token(self, name: str, token: str, profile: gr.OAuthProfile | None = None) -> Updates:
        """Ask the Hub who the token is, then keep it; a token the Hub refuses is not kept."""
        services = self.panel.services(profile)
        if not (token or "").strip():
            return {self.result: cards.field_error(["Paste a token first."]), self.token: "", **self.refresh(profile)}
        try:
            identity = services.check_hf_token(token)
        except TokenRefused as error:
            return {self.result: cards.field_error([f"Not saved: {error}"]), self.token: "", **self.refresh(profile)}
        credential = services.credentials.save(services.owner, (name or "hf-token").strip(), "hf_token", token)
        if identity is None:
            saved = cards.note(
                f"Saved {credential.name} ({credential.masked}) unchecked: the Hub could not be reached to confirm "
                "it. Check settings on the Launch page tries it again.",
                "warn",
            )
        else:
            saved = cards.note(f"Saved {credential.name} ({credential.masked}): {identity.describe()}.", "good")
        return {self.result: saved, self.token: "", **self.refresh(profile)}

    def save_wandb_key(self, name: str, key: str, profile: gr.OAuthProfile | None = None) -> Updates:
        """Keep a W&B key. W&B is not asked from here: the trainer logs in with it when its run reports to W&B."""
        services = self.panel.services(profile)
        key = (key or "").strip()
        if len(key) < MIN_WANDB_KEY or any(character.isspace() for character in key):
            too_short = f"Not saved: a W&B key is {MIN_WANDB_KEY} characters or more, no spaces."
            problem = too_short if key else "Paste a key first."
            return {
                self.result: cards.field_error([f"{problem} Copy yours from wandb.ai/authorize."]),
                self.wandb_key: "",
                **self.refresh(profile),
            }
        credential = services.credentials.save(services.owner, (name or "wandb").strip(), "wandb", key)
        saved = cards.note(
            f"Saved {credential.name} ({credential.masked}). Pick it on the Launch page under Reporting; W&B checks "
            "it when the trainer logs in.",
            "good",
        )
        return {self.result: saved, self.wandb_key: "", **self.refresh(profile)}

    def ask_delete(self, credential_id: int | None, profile: gr.OAuthProfile | None = None) -> Updates:
        """Deleting cannot be undone: say what goes, and wait for a second click."""
        services = self.panel.services(profile)
        if credential_id is None:
            return {
                self.confirm_row: gr.Row(visible=False),
                self.result: cards.note("Pick a credential to delete.", "warn"),
            }
        credential = services.credentials.get(services.owner, int(credential_id))
        question = cards.note(
            f"Delete {credential.name} ({credential.masked})? Runs that use it can no longer start or publish until "
            "you give them another; this cannot be undone.",
            "warn",
        )
        return {self.confirm_row: gr.Row(visible=True), self.confirm_text: question, self.result: ""}

    def delete(self, credential_id: int | None, profile: gr.OAuthProfile | None = None) -> Updates:
        services = self.panel.services(profile)
        hidden = {self.confirm_row: gr.Row(visible=False), self.confirm_text: ""}
        if credential_id is None:
            return {**hidden, self.result: cards.note("Pick a credential to delete.", "warn"), **self.refresh(profile)}
        services.credentials.delete(services.owner, int(credential_id))
        return {**hidden, self.result: cards.note("Deleted.", "good"), **self.refresh(profile)}


def _secret_row(
    name: str, label: str, placeholder: str, button: str, key: str
) -> tuple[gr.Textbox, gr.Textbox, gr.Button]:
    """A row to save one secret under a name: (name box, secret box, save button), ids `account-<key>` and
    `save-<key>`."""
    with gr.Row(elem_classes="gp-align-end"):
        name_box = gr.Textbox(name, label="Name", scale=1)
        secret_box = gr.Textbox(
            label=label, type="password", scale=3, elem_id=f"account-{key}", placeholder=placeholder
        )
        return name_box, secret_box, gr.Button(button, elem_id=f"save-{key}", scale=1)
