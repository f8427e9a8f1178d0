"""What the jobs import is what the jobs install: TRL's async GRPO sources against requirements-jobs.txt, and the
bootstrap's and the trainer's checks of the pins."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import trl

from jobs import pins
from jobs.contract import layout

ASYNC_GRPO = Path(trl.__file__).parent / "experimental" / "async_grpo"
# What the job image (vllm/vllm-openai) brings, as requirements-jobs.txt's header says.
IN_THE_IMAGE = {"torch", "transformers", "vllm", "numpy", "aiohttp", "requests"}
# Imported by TRL's async GRPO code on paths a run of ours never takes, each with the reason.
NOT_ON_OUR_PATH = {
    "trackio": "only when a run reports to Trackio: that trainer installs it (requirements-reporting.txt)",
    "openenv": "only by openenv_harness.py, for environment rollouts; our rollouts are completions",
}
# Import names whose distribution is called otherwise.
DISTRIBUTIONS = {"huggingface_hub": "huggingface-hub"}


def third_party_imports(folder: Path) -> dict[str, set[str]]:
    """{top-level module: the files importing it} for every absolute import outside the standard library, those
    inside functions (imported at run time) included."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "trl":
                    found.setdefault(top, set()).add(path.name)
    return found


def test_every_package_trls_async_grpo_imports_is_installed_in_the_jobs():
    """A TRL bump that starts importing another optional package (as 1.16 did with `kernels` at the first CUDA
    forward) fails here until it is pinned in requirements-jobs.txt, or shown to be off our path."""
    imported = third_party_imports(ASYNC_GRPO)
    assert {"kernels", "peft", "accelerate"} <= set(imported)  # the scan sees run-time imports inside functions
    pinned = {name.lower() for name in pins.pins()}
    missing = {
        module: sorted(files)
        for module, files in imported.items()
        if module not in IN_THE_IMAGE
        and module not in NOT_ON_OUR_PATH
        and DISTRIBUTIONS.get(module, module).lower() not in pinned
    }
    assert missing == {}, f"pin these in requirements-jobs.txt (or add them to NOT_ON_OUR_PATH, with why): {missing}"


def test_the_pins_parse_and_a_version_mismatch_is_reported_by_name(tmp_path):
    requirements = tmp_path / "requirements-jobs.txt"
    requirements.write_text("# comment\ntrl[peft]==1.16.0  # pinned\npeft==0.0.1\nnot-installed-anywhere==1.0\n")
    assert pins.pins(requirements) == {"trl": "1.16.0", "peft": "0.0.1", "not-installed-anywhere": "1.0"}
    assert pins.unmet(requirements) == {"peft": pins.installed("peft"), "not-installed-anywhere": None}
    pins.require("trl", requirements)  # installed at its pin here
    with pytest.raises(RuntimeError, match=r"needs peft==0\.0\.1 \(requirements-jobs\.txt\) but found 0\.21\.2"):
        pins.require("peft", requirements)


def test_this_test_environment_meets_every_job_pin():
    """Jobs the Hub emulator runs use this interpreter: with every pin met, their bootstrap installs nothing."""
    assert pins.unmet() == {}


def test_a_trainer_finding_another_trl_fails_at_once_and_says_which_it_found(tmp_path):
    """The trainer job itself, in a subprocess where TRL reports version 1.15.0: it fails before waiting for any
    replica, and its status names the pin and the version found."""
    from jobs.demo.preset import demo_spec
    from jobs.store import LocalStore
    from tests.support.replica import write_spec

    store = LocalStore(tmp_path / "store")
    uri = write_spec(store, demo_spec("pin-check", f"file://{tmp_path / 'store'}"))
    other_trl = (
        "import sys; from jobs import pins; installed = pins.installed; "
        "pins.installed = lambda name: '1.15.0' if name == 'trl' else installed(name); "
        "from jobs.trainer.job import main; sys.exit(main(sys.argv[1:]))"
    )
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", other_trl, "--spec", uri, "--replica-wait", "5", "--output-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stderr[-2000:]
    status = json.loads(store.get_bytes(layout.status_key("pin-check", "trainer")))
    assert status["phase"] == "failed"
    assert "needs trl==1.16.0 (requirements-jobs.txt) but found 1.15.0" in status["last_error"], status
