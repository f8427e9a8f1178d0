"""The project's `jobs/` package at an earlier git revision, to run beside today's in one benchmark (`--baseline`)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(revision: str) -> Path:
    """A folder holding `jobs/` as it was at git `revision` (run a process from it with it as cwd and PYTHONPATH)."""
    folder = Path(tempfile.mkdtemp(prefix="baseline-"))
    archive = subprocess.run(["git", "archive", revision, "jobs"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder
