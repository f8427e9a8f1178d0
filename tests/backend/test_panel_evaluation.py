"""Which runs the panel evaluates itself (backend/services/evaluation.py's `environment_refusal`): never one whose tools
are the user's code, and on a Space not one whose `python` tool runs the model's programs; every other run, on a Space
or not. The refusal names the run and says where its versions are evaluated instead."""

from __future__ import annotations

import pytest

from backend.services.evaluation import environment_refusal
from jobs.contract import EnvironmentSpec

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
