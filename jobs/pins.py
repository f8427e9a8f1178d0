"""The package versions the jobs are pinned to (requirements-jobs.txt), and which of them this interpreter lacks.

Standard library only: the job bootstrap (jobs/bootstrap.py) imports it right after unpacking the code bundle, before
anything is installed, to decide whether the image's packages will do or the pinned ones must be installed. The
trainer checks again at start, so a pin the install could not satisfy is reported by name instead of surfacing as an
obscure error in TRL's internals hours later.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements-jobs.txt"
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)")


def pins(path: Path = REQUIREMENTS) -> dict[str, str]:
    """{distribution name: pinned version} of every `name==version` line."""
    found = {}
    for line in path.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet(path: Path = REQUIREMENTS) -> dict[str, str | None]:
    """{name: the version installed here, None if none} for every pin this interpreter does not satisfy."""
    return {name: installed(name) for name, version in pins(path).items() if installed(name) != version}


def missing(requirements: list[str]) -> list[str]:
    """Each `name==version` of `requirements` this interpreter lacks at that version."""
    lacking = []
    for requirement in requirements:
        match = _PIN.match(requirement)
        if match is None or installed(match.group(1)) != match.group(2):
            lacking.append(requirement)
    return lacking


def install_missing(requirements: list[str], needed_for: str) -> list[str]:
    """pip-install what `missing` names of `requirements` (`needed_for` says why, in the log and the error); what was
    installed. A job installs the packages a run asks for that its image lacks."""
    lacking = missing(requirements)
    if lacking:
        print(f"installing {', '.join(lacking)} {needed_for}", flush=True)
        if subprocess.call([sys.executable, "-m", "pip", "install", "-q", *lacking]) != 0:
            raise RuntimeError(
                f"could not install {', '.join(lacking)} {needed_for}; check the job log for pip's error"
            )
    return lacking


def require(name: str, path: Path = REQUIREMENTS) -> None:
    """Raise RuntimeError saying what was found unless `name` is installed at its pinned version."""
    wanted, found = pins(path)[name], installed(name)
    if found != wanted:
        raise RuntimeError(
            f"this job needs {name}=={wanted} (requirements-jobs.txt) but found "
            f"{found or 'none'}; the image's {name} was not replaced: check the job log for pip's error"
        )
