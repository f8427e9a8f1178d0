"""Every environment variable is declared once (backend/settings.py, jobs/settings.py) and documented in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend import settings as panel_settings
from jobs import settings as job_settings
from jobs.settings import Variable

ROOT = Path(__file__).resolve().parent.parent
# A read of a variable named in the code: os.environ["X"], os.environ.get("X"), os.getenv("X"), environ.get("X").
_READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']""")
# The process's own environment, extended for child processes or used for scratch: no setting of ours.
_STANDARD = {"PYTHONPATH", "TMPDIR"}
# The bootstrap runs before the project's code is importable (standard library only): it reads the bucket keys
# itself, by the names jobs/settings.py declares.
_BOOTSTRAP = "jobs/bootstrap.py"


def test_the_readme_shows_the_tables_the_declarations_make():
    readme = (ROOT / "README.md").read_text()
    shown = readme.split("<!-- settings:begin -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert shown == panel_settings.markdown(), "run `python -m backend.settings` and paste it into the README"


def test_no_module_reads_a_variable_by_name_except_through_its_declaration():
    reads, bootstrap = [], set()
    for path in sorted(ROOT.glob("*/**/*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.split("/")[0] not in ("app", "backend", "jobs") or relative.endswith("/settings.py"):
            continue
        names = set(_READ.findall(path.read_text())) - _STANDARD
        if relative == _BOOTSTRAP:
            bootstrap = names
        else:
            reads += [(relative, name) for name in sorted(names)]
    assert reads == []
    declared = {variable.name for variable in job_settings.JOB_VARIABLES}
    assert bootstrap and bootstrap <= declared, bootstrap - declared


def test_every_variable_is_declared_once_and_each_secret_is_masked_in_job_logs():
    names = [variable.name for variable in (*panel_settings.PANEL_VARIABLES, *job_settings.JOB_VARIABLES)]
    assert len(names) == len(set(names))
    assert {"GRPO_TRAINER_WORKDIR", "GRPO_REPLICA_LOSS_TIMEOUT", "GRPO_TORCH_THREADS", "GRPO_MODEL_CACHE"} <= set(names)
    assert set(job_settings.SECRET_VARIABLES) >= {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "UPSTREAM_TOKEN"}


def test_an_unset_or_blank_variable_reads_as_its_default_and_a_bad_number_names_the_variable():
    timeout = Variable("GRPO_EXAMPLE_TIMEOUT", "an example", "180")
    assert timeout.number({}) == 180.0 and timeout.number({"GRPO_EXAMPLE_TIMEOUT": "  "}) == 180.0
    assert timeout.number({"GRPO_EXAMPLE_TIMEOUT": " 30 "}) == 30.0
    assert Variable("GRPO_EXAMPLE_FOLDER", "an example", when_unset="a temporary folder").get({}) is None
    with pytest.raises(ValueError, match="GRPO_EXAMPLE_TIMEOUT='soon' is not a number"):
        timeout.number({"GRPO_EXAMPLE_TIMEOUT": "soon"})
