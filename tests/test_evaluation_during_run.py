"""Held-out evaluation during a run (issue 29): which versions, at what cost, scored as training scores, and an
evaluator that can fail without touching training. The evaluator beside a real run is in tests/test_e2e_demo.py
(`test_held_out_evaluation_during_the_run_...`); its proxy endpoints in tests/test_proxy_adapters.py."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.contract import RewardSpec, derived
from jobs.demo.preset import demo_spec
from jobs.evaluation.during_run import RunEvaluator, Scorer
from jobs.evaluation.heldout import EvalPrompts
from jobs.evaluation.results import score_table
from jobs.evaluation.sampling import Completion
from jobs.store import LocalStore
from jobs.trainer.evaluator_process import EvaluatorProcess
from jobs.trainer.rewards import build_rewards
from tests.support.waiting import wait_until


def spec(tmp_path: Path, steps: int = 40, sync: int = 1, **evaluation: object):
    return demo_spec(
        "during-run",
        f"file://{tmp_path / 'store'}",
        grpo={"max_steps": steps, "weight_sync_steps": sync},
        eval={"split": "test", **evaluation},
    )


@pytest.mark.parametrize("steps", [40, 500])
@pytest.mark.parametrize("sync", [1, 4])
@pytest.mark.parametrize(("prompts", "k"), [(32, 4), (128, 4), (16, 1)])
def test_the_default_interval_is_the_shortest_that_keeps_evaluation_within_a_tenth_of_the_rollouts(
    tmp_path, steps, sync, prompts, k
):
    run = spec(tmp_path, steps, sync, prompts=prompts, k=k)
    cost = derived.eval_cost(run)
    last = steps // sync + 1
    if cost.every < last:  # evaluations between the base model and the last version are affordable
        assert cost.token_share <= derived.EVAL_TOKEN_SHARE
        if cost.every > 1:
            shorter = derived.eval_cost(spec(tmp_path, steps, sync, prompts=prompts, k=k, every=cost.every - 1))
            assert shorter.token_share > derived.EVAL_TOKEN_SHARE
    else:  # even the base model and the last version cost more: nothing in between
        assert cost.evaluations == 2
    assert cost.evaluations == 2 + sum(derived.version_due(v, cost.every) for v in range(2, last))


def test_an_interval_asked_for_is_kept_and_the_plan_counts_the_held_out_prompts_found(tmp_path):
    demo = demo_spec("during-run", f"file://{tmp_path / 'store'}")
    assert derived.eval_cost(demo, 32) == derived.EvalCost(10, 5, 0.25)  # v0, v11, v21, v31, v41: 5 x 2,048 tokens
    assert [v for v in range(1, 42) if derived.version_due(v, 10)] == [11, 21, 31, 41]
    assert derived.eval_cost(spec(tmp_path), 32).every == 41  # unasked: only the base model and the last version
    assert derived.replica_max_loras(demo) == derived.vllm_max_loras(1) + 1  # the evaluation's own slot
    assert derived.replica_max_loras(spec(tmp_path, during_run=False)) == derived.vllm_max_loras(1)


def prompts(count: int) -> EvalPrompts:
    records = [{"prompt": [{"role": "user", "content": f"p{i}"}], "answer": str(i)} for i in range(count)]
    return EvalPrompts(records, [[1, 2, 3]] * count, [f"p{i}" for i in range(count)], "split 'test'")


def test_an_evaluator_that_fell_behind_evaluates_the_newest_due_version_and_says_which_it_skipped(tmp_path, capsys):
    run = spec(tmp_path, every=10)
    evaluator = RunEvaluator(
        run, LocalStore(tmp_path / "store"), "http://127.0.0.1:9", prompts(2), Scorer([], []), "a" * 16
    )
    assert evaluator.due(10) is None
    assert evaluator.due(35) == 31
    said = capsys.readouterr().out
    assert "v21 skipped, v31 evaluated instead" in said and "v11 skipped" in said
    evaluator.tried.add(31)
    assert evaluator.due(35) is None and evaluator.due(41) == 41


def test_held_out_completions_are_scored_by_the_runs_rewards_with_their_weights_as_in_training():
    """The total is the sum of the weighted rewards, as TRL's `reward`; each reward as it weighs in training."""
    table = score_table(["a", "b"], [[0.5, None, 1.0, 2.0], [1.0, 1.0, float("nan"), 1.0]], k=2)
    assert table == {
        "reward": [[1.5, 1.0], [1.0, 3.0]],
        "rewards/a": [[0.5, 0.0], [1.0, 2.0]],
        "rewards/b": [[1.0] * 2, [0.0, 1.0]],
    }
    reward = RewardSpec(kind="builtin", name="digit_frac", weight=2.0)
    scorer = Scorer(["digit_frac"], list(build_rewards([reward])))
    sampled = [[Completion("12", [16, 17]), Completion("ab", [5, 6])]]
    scores = scorer.score(prompts(1), sampled)
    assert scores["rewards/digit_frac"] == scores["reward"]
    assert scores["reward"][0][1] == 0.0 and scores["reward"][0][0] > 1.0  # weighted: a fraction, doubled


class Events:
    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def event(self, kind: str, message: str, level: str = "info") -> None:
        with self.lock:
            self.said.append((level, message))

    def messages(self) -> str:
        with self.lock:
            return "\n".join(message for _, message in self.said)


def evaluator_script(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "evaluator.py"
    script.write_text("import json, pathlib, sys, time\n" + body)
    return [sys.executable, str(script)]


def test_an_evaluator_that_dies_is_started_again_and_the_last_version_still_evaluated(tmp_path):
    """It dies once (as a crash would), is started again with a warning, forwards what it says, and gets to
    evaluate the version the trainer names at the end."""
    final, crashed = tmp_path / "final", tmp_path / "crashed"
    command = evaluator_script(
        tmp_path,
        f"""
if not pathlib.Path({str(crashed)!r}).exists():
    pathlib.Path({str(crashed)!r}).touch()
    sys.exit(3)
print(json.dumps({{"level": "warning", "message": "held-out evaluation of v11 skipped: a test"}}), flush=True)
while not pathlib.Path({str(final)!r}).exists():
    time.sleep(0.05)
print(json.dumps({{"level": "info", "message": "evaluated v" + pathlib.Path({str(final)!r}).read_text()}}), flush=True)
""",
    )
    events = Events()
    evaluator = EvaluatorProcess(command, final, events, check_every=0.1).start()
    wait_until(lambda: "v11 skipped" in events.messages(), 60, 0.1, what="the restarted evaluator's notice")
    started = time.monotonic()
    evaluator.finish(41, timeout=60)
    assert time.monotonic() - started < 30 and evaluator.process is not None and evaluator.process.returncode == 0
    wait_until(lambda: "evaluated v41" in events.messages(), 10, 0.1, what="the last notice")
    assert ("warning", "the held-out evaluator exited with code 3; started again (1 of 3)") in events.said


def test_an_evaluator_that_keeps_dying_is_given_up_on_and_one_that_hangs_at_the_end_is_stopped(tmp_path):
    events = Events()
    dying = EvaluatorProcess(evaluator_script(tmp_path, "sys.exit(5)\n"), tmp_path / "f1", events, 0.05).start()
    wait_until(lambda: "no more versions are evaluated" in events.messages(), 60, 0.1, what="giving up")
    assert dying.restarts == 3
    dying.stop()
    hanging = EvaluatorProcess(evaluator_script(tmp_path, "time.sleep(600)\n"), tmp_path / "f2", events).start()
    hanging.finish(9, timeout=0.5)
    assert hanging.process is not None and hanging.process.returncode is not None
    assert "evaluation of the last version v9 did not end within 0 s" in events.messages()
