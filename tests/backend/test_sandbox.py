"""The reward sandbox: scores or clear errors, and no secrets (hostile code: tests/backend/test_hostile_rewards.py)."""

from __future__ import annotations

import pytest

from backend.sandbox.client import SandboxLimits, run_rewards
from jobs.contract import RewardSpec

ROWS = [
    {"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"},
    {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},
]
COMPLETIONS = [r"\boxed{2}", r"\boxed{5}"]


def code(body: str, name: str = "mine") -> RewardSpec:
    return RewardSpec(kind="code", name=name, source=body, entry_point="f")


def trial(body: str, limits: SandboxLimits = SandboxLimits()):
    (result,) = run_rewards([code(body)], ROWS, COMPLETIONS, limits)
    return result


def test_builtin_and_user_rewards_score_every_row():
    user = code(
        "def f(completions, answer, **kw):\n    return [float(a in c[0]['content']) "
        "for c, a in zip(completions, answer)]\n"
    )
    boxed, mine = run_rewards([RewardSpec(name="math_boxed"), user], ROWS, COMPLETIONS)
    assert boxed.scores == [1.0, 0.0] and boxed.error is None
    assert mine.scores == [1.0, 0.0]


def test_math_boxed_checks_answers_symbolically_in_the_sandbox():
    """Its math_verify fallback loads sympy's C code, which the sandbox forbids to user code: loaded beforehand."""
    (boxed,) = run_rewards([RewardSpec(name="math_boxed")], ROWS, [r"\boxed{\frac{4}{2}}", r"\boxed{2^2}"])
    assert (boxed.scores, boxed.error) == ([1.0, 1.0], None)


@pytest.mark.parametrize(
    ("body", "fragment", "row"),
    [
        ("def f(completions, **kw):\n    raise ValueError('boom')\n", "ValueError: boom", None),
        ("def f(completions, **kw):\n    return [1.0]\n", "returned 1 scores for 2 completions", None),
        ("def f(completions, **kw):\n    return [1.0, float('nan')]\n", "row 1: returned nan", 1),
        ("def f(completions, **kw):\n    return ['high', 1.0]\n", "row 0: returned str", 0),
        ("def f(completions, **kw)\n    return []\n", "syntax error on line 1", None),
    ],
)
def test_errors_name_the_problem_and_the_row(body, fragment, row):
    result = trial(body)
    assert result.scores == [] and fragment in result.error
    assert result.row == row


def test_no_secrets_in_the_environment(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretsecretsecretsecret1234")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "shhh-very-secret")
    body = (
        "import os\ndef f(completions, **kw):\n    leaked = [k for k in os.environ if 'TOKEN' in k or 'AWS' in k "
        "or 'SECRET' in k]\n    return [float(len(leaked))] * len(completions)\n"
    )
    assert trial(body).scores == [0.0, 0.0]
