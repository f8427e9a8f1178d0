"""Which runs the panel evaluates itself (backend/services/evaluation.py's `environment_refusal`): never one whose tools
are the user's code, and on a Space not one whose `python` tool runs the model's programs; every other run, on a Space
or not. The refusal names the run and says where its versions are evaluated instead; `EvaluationService.evaluate` raises
it for a local run before it loads the run's model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import jobs.models
from backend.context import PanelContext
from backend.database.connection import Database
from backend.services import evaluation
from backend.services.evaluation import EvaluationError, EvaluationService, environment_refusal
from backend.services.runs import RunService
from jobs.contract import EnvironmentSpec
from jobs.demo.preset import agent_demo_spec

USER_TOOLS = 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n    return a + b\n'
ENVIRONMENTS = {
    "no environment": EnvironmentSpec(),
    "codebook": EnvironmentSpec(kind="builtin", name="codebook"),
    "calculator": EnvironmentSpec(kind="builtin", name="calculator"),
    "python": EnvironmentSpec(kind="builtin", name="python"),
    "user code": EnvironmentSpec(kind="code", source=USER_TOOLS, entry_point="add"),
}
REFUSED = {("user code", False), ("user code", True), ("python", True)}


@pytest.mark.parametrize("space", [False, True], ids=["local", "space"])
@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
def test_the_panel_evaluates_a_run_unless_its_tools_run_code_it_may_not(environment: str, space: bool) -> None:
    refused = environment_refusal("the-run", ENVIRONMENTS[environment], space)
    if (environment, space) in REFUSED:
        assert refused is not None
        assert refused.startswith("environment: run the-run's tools run code this panel runs only in its sandbox")
        assert "evaluated while it trains (eval.split or eval.holdout at launch)" in refused
    else:
        assert refused is None


class ModelLoaded(Exception):
    """Raised in place of loading the run's model: the refusal must come before it."""


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EvaluationService]:
    """The evaluation service of a fresh panel whose model loading raises ModelLoaded instead."""

    def no_model(*args: object, **kwargs: object) -> str:
        raise ModelLoaded

    monkeypatch.setattr(jobs.models, "resolve_model", no_model)
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel")
    yield EvaluationService(ctx, "local")
    ctx.db.close()


def local_run(service: EvaluationService, run_id: str, environment: dict[str, str], storage: Path) -> str:
    """A local agent run (the agent demo's, with `environment` in place of its tools), created and never launched."""
    spec = agent_demo_spec(run_id, f"file://{storage}", environment=environment)
    RunService(service.ctx, "local").create(spec)
    return run_id


@pytest.mark.parametrize("space", [False, True], ids=["local", "space"])
def test_evaluating_a_run_of_user_code_is_refused_before_its_model_loads(
    service: EvaluationService, space: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(evaluation, "on_space", lambda: space)
    tools = {"kind": "code", "source": USER_TOOLS, "entry_point": "add"}
    run_id = local_run(service, "user-tools", tools, tmp_path / "store")
    with pytest.raises(EvaluationError) as refused:
        service.evaluate(run_id, [0])
    assert str(refused.value) == environment_refusal(run_id, ENVIRONMENTS["user code"], space)


def test_evaluating_a_run_of_the_python_tool_is_refused_on_a_space_only(
    service: EvaluationService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = local_run(service, "python-tool", {"kind": "builtin", "name": "python"}, tmp_path / "store")
    monkeypatch.setattr(evaluation, "on_space", lambda: True)
    with pytest.raises(EvaluationError) as refused:
        service.evaluate(run_id, [0])
    assert str(refused.value) == environment_refusal(run_id, ENVIRONMENTS["python"], True)
    monkeypatch.setattr(evaluation, "on_space", lambda: False)
    with pytest.raises(ModelLoaded):  # off a Space the evaluation goes on to the run's model
        service.evaluate(run_id, [0])
