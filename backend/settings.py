"""Every environment variable the panel reads, declared once (the jobs' are in jobs/settings.py).

`python -m backend.settings` prints both tables as the README shows them; tests/test_settings.py keeps the README
equal to it and checks that no module reads the environment except through these declarations.
"""

from __future__ import annotations

from jobs.settings import JOB_VARIABLES, Variable

DATA = Variable(
    "GRPO_PANEL_DATA", "the panel's folder: its database, vault key, local runs and store", when_unset="`data/` here"
)
KEY = Variable(
    "GRPO_PANEL_KEY",
    "the key that encrypts saved tokens and bucket keys (on a Space: a Space secret)",
    when_unset="`secret.key` in the data folder",
    secret=True,
)
SNAPSHOTS = Variable(
    "GRPO_PANEL_SNAPSHOTS",
    "a folder on persistent storage (a Space's bucket mount) that keeps a copy of the database every 5 minutes",
    when_unset="no snapshots",
)
LIMITS = Variable(
    "GRPO_PANEL_LIMITS",
    "per-user limits, e.g. `runs=2,checks=1,reward_tests=10`",
    when_unset="`runs=4,checks=2,reward_tests=30`",
)
HF_ENDPOINT = Variable("HF_ENDPOINT", "the Hub to talk to (huggingface_hub reads it too)", when_unset="huggingface.co")
SERVER_NAME = Variable("GRADIO_SERVER_NAME", "the address the panel listens on (0.0.0.0 on a Space)", "127.0.0.1")
SERVER_PORT = Variable("GRADIO_SERVER_PORT", "the port the panel listens on", "7860")
SPACE_ID = Variable(
    "SPACE_ID", "set inside a Hugging Face Space: sign-in, per-user data, confined reward code", set_by="Spaces"
)
SYSTEM = Variable("SYSTEM", "`spaces` inside a Hugging Face Space (as SPACE_ID)", set_by="Spaces")

PANEL_VARIABLES = (DATA, KEY, SNAPSHOTS, LIMITS, HF_ENDPOINT, SERVER_NAME, SERVER_PORT, SPACE_ID, SYSTEM)


def markdown() -> str:
    """The README's tables of environment variables."""
    header = "| variable | what it does | when unset | set by |\n|---|---|---|---|"
    panel = "\n".join(variable.markdown_row() for variable in PANEL_VARIABLES)
    jobs = "\n".join(variable.markdown_row() for variable in JOB_VARIABLES)
    return f"The panel:\n\n{header}\n{panel}\n\nThe jobs:\n\n{header}\n{jobs}\n"


if __name__ == "__main__":
    print(markdown(), end="")
