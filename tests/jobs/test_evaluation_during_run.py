"""Held-out evaluation during a run (issue 29): which versions, at what cost, scored as training scores, and an
evaluator that can fail without touching training. The evaluator beside a real run is in tests/test_e2e_demo.py
(`test_held_out_evaluation_during_the_run_...`); its proxy endpoints in tests/jobs/test_proxy_adapters.py."""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.contract import RewardSpec, derived
from jobs.demo.preset import demo_spec
from jobs.evaluation.during_run import RunEvaluator, Scorer
from jobs.evaluation.heldout import EvalPrompts
from jobs.evaluation.results import score_names, score_table, scored_functions
from jobs.evaluation.sampling import Completion
from jobs.evaluation.statistics import Interval, stalled
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
    assert "fell behind: v11, v21 skipped, v31 evaluated instead" in capsys.readouterr().out
    assert evaluator.due(35) is None and evaluator.due(41) == 41
    assert capsys.readouterr().out == ""  # each skip said once


def test_a_branch_is_also_evaluated_at_its_starting_point_the_parent_version_it_was_branched_from(tmp_path):
    """A branch's v1 holds its parent version's weights, not the base model's: that is what the branch has to beat,
    so it is evaluated too (and counted in what evaluation costs); on a run from the base model it never is."""
    trunk = spec(tmp_path, every=10)
    branch = type(trunk).model_validate({**trunk.model_dump(), "parent": {"run_id": "trunk", "version": 17}})
    assert derived.eval_cost(branch, 32).evaluations == derived.eval_cost(trunk, 32).evaluations + 1
    store = LocalStore(tmp_path / "store")
    for run, first_due in ((branch, 1), (trunk, None)):
        evaluator = RunEvaluator(run, store, "http://127.0.0.1:9", prompts(2), Scorer([], []), "a" * 16)
        assert evaluator.due(1) == first_due
        assert evaluator.due(11) == 11  # then every tenth, as on any run
        assert evaluator.due(11) is None


def test_held_out_completions_are_scored_by_the_runs_rewards_with_their_weights_as_in_training():
    """The total is the sum of the weighted rewards, as TRL's `reward`; each reward as it weighs in training; an eval
    metric is reported beside them and never counted in the total (it is not trained on)."""
    weighted = [[0.5, None, 1.0, 2.0], [1.0, 1.0, float("nan"), 1.0], [1.0, 0.0, 0.0, 1.0]]
    table = score_table(["rewards/a", "rewards/b", "metrics/exact"], weighted, k=2)
    assert table == {
        "reward": [[1.5, 1.0], [1.0, 3.0]],
        "rewards/a": [[0.5, 0.0], [1.0, 2.0]],
        "rewards/b": [[1.0] * 2, [0.0, 1.0]],
        "metrics/exact": [[1.0, 0.0], [0.0, 1.0]],
    }
    exact = RewardSpec(kind="code", name="exact", source=EXACT, entry_point="exact")
    run = demo_spec(
        "during-run",
        "file:///unused",
        rewards=[{"kind": "builtin", "name": "digit_frac", "weight": 2.0}],
        eval={"split": "test", "metrics": [exact.model_dump()]},
    )
    assert score_names(run) == ["rewards/digit_frac", "metrics/exact"]
    scorer = Scorer(score_names(run), list(build_rewards(scored_functions(run))))
    sampled = [[Completion("12", [16, 17]), Completion("ab", [5, 6])]]
    scores = scorer.score(prompts(1), sampled)
    assert scores["rewards/digit_frac"] == scores["reward"]
    assert scores["reward"][0][1] == 0.0 and scores["reward"][0][0] > 1.0  # weighted: a fraction, doubled
    assert scores["metrics/exact"] == [[1.0, 0.0]]  # unweighted, and not in the total


EXACT = "def exact(completions, **columns):\n    return [float(c[0]['content'] == '12') for c in completions]\n"


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
    assert "evaluated v41" in events.messages()  # forwarded before finish returns: the trainer reports it next
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


def test_each_versions_scores_reach_the_trainers_reports_as_eval_keys_and_never_the_panels_metrics(tmp_path):
    """The evaluator prints each stored record; the trainer hands it to Trackio and W&B on its next log line as
    `eval_<score>` (their callbacks name it `eval/<score>`), newest version last, and the panel's metrics stream
    leaves those keys out: it reads the `eval` stream."""
    from jobs.trainer.held_out_reports import HeldOutReports
    from jobs.trainer.telemetry import TelemetryCallback

    record = {"version": 11, "step": 10, "scores": {"reward": {"mean": 0.25}, "metrics/exact": {"mean": 0.5}}}
    older = {"version": 0, "step": 0, "scores": {"reward": {"mean": 0.05}}}
    script = f"print(json.dumps({{'scores': {record!r}}}), flush=True)\ntime.sleep(600)\n"
    reports, events = HeldOutReports(), Events()
    evaluator = EvaluatorProcess(evaluator_script(tmp_path, script), tmp_path / "f", events, on_scores=reports.add)
    evaluator.start()
    try:
        wait_until(lambda: reports._pending, 60, 0.1, what="the evaluator's scores")
    finally:
        evaluator.stop()
    assert events.said == []  # scores are not events
    reports.add(older)  # arrived later, but an older version: the newer one's scores win
    logs = {"loss": 1.0}
    reports.on_log(None, None, None, logs=logs)
    assert logs == {
        "loss": 1.0,
        "eval_reward": 0.25,
        "eval_metrics/exact": 0.5,
        "eval_version": 11.0,
        "eval_version_step": 10.0,
    }
    reports.on_log(None, None, None, logs=(again := {"loss": 0.9}))
    assert again == {"loss": 0.9}  # each record once

    class Telemetry:
        attempt, metrics = 1, type("Stream", (), {"add": lambda self, record: added.append(record)})()

    added: list[dict[str, object]] = []
    TelemetryCallback(Telemetry()).on_log(None, type("State", (), {"global_step": 10})(), None, logs=logs)
    assert added[0]["loss"] == 1.0 and not [key for key in added[0] if key.startswith("eval_")]


def test_a_stall_is_when_the_last_evaluations_never_beat_the_best_by_more_than_its_interval():
    def history(*points: tuple[int, float]) -> list[tuple[int, Interval]]:
        return [(version, Interval(mean, mean - 0.05, mean + 0.05)) for version, mean in points]

    rising = history((0, 0.1), (11, 0.2), (21, 0.3), (31, 0.4))
    assert stalled(rising, 2) is None
    within = history((0, 0.1), (11, 0.5), (21, 0.54), (31, 0.52))  # v21 is higher, but within v11's interval
    assert stalled(within, 2) == 11 and stalled(within, 3) is None
    falling = history((0, 0.1), (11, 0.5), (21, 0.3), (31, 0.2), (41, 0.1))
    assert stalled(falling, 3) == 11 and stalled(falling, 4) is None
    assert stalled(history((0, 0.1)), 1) is None and stalled([], 1) is None
    one_prompt = [(0, Interval(0.1, -math.inf, math.inf)), (11, Interval(0.0, -math.inf, math.inf))]
    assert stalled(one_prompt * 3, 2) is None  # no interval: never a stall


def test_a_stalled_held_out_reward_raises_an_alert_and_with_stop_on_regression_stops_and_keeps_the_best(
    tmp_path, capsys
):
    import json

    from jobs.contract import layout
    from jobs.contract.control import STOP

    store = LocalStore(tmp_path / "store")
    alert_only = RunEvaluator(spec(tmp_path, patience=2), store, "", prompts(1), Scorer([], []), "a" * 16)
    alert_only.history = [
        (0, Interval(0.1, 0.05, 0.15)),
        (11, Interval(0.5, 0.45, 0.55)),
        (21, Interval(0.4, 0.3, 0.5)),
    ]
    alert_only.judge()
    assert capsys.readouterr().out == ""  # one evaluation since the best: not yet
    alert_only.history.append((31, Interval(0.52, 0.47, 0.57)))
    alert_only.judge()
    alert_only.judge()  # said once
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(said) == 1 and (said[0]["level"], said[0]["kind"]) == ("error", "held_out_stalled")
    assert "not beaten v11's 0.500" in said[0]["message"] and "training goes on" in said[0]["message"]
    assert not store.exists(layout.control_key("during-run", STOP))
    alert_only.make_best_current()
    assert not store.exists(layout.current_key("during-run"))  # nothing stopped: current stays the trainer's

    stopping = RunEvaluator(
        spec(tmp_path, patience=2, stop_on_regression=True), store, "", prompts(1), Scorer([], []), "b" * 16
    )
    stopping.history = list(alert_only.history)
    stopping.judge()
    assert "the run stops" in capsys.readouterr().out
    assert "eval.stop_on_regression" in json.loads(store.get_bytes(layout.control_key("during-run", STOP)))["reason"]
    stopping.history.append((41, Interval(0.3, 0.2, 0.4)))
    stopping.make_best_current()
    assert store.get_bytes(layout.current_key("during-run")) == b"31"  # the highest mean among adapter versions


def test_a_restarted_evaluator_knows_the_scores_stored_before_it(tmp_path):
    from jobs.contract import layout
    from jobs.evaluation.results import VersionEval

    store = LocalStore(tmp_path / "store")
    for version, score in ((11, 0.5), (0, 0.1)):
        result = VersionEval("during-run", version, "c" * 16, "split 'test'", {}, 1, ["p"] * 2, [["a"]] * 2,
                             {"reward": [[score], [score]]}, 1.0)  # fmt: skip
        store.put_bytes(layout.eval_key("during-run", version, "c" * 16), result.to_json().encode())
    evaluator = RunEvaluator(spec(tmp_path, every=10), store, "", prompts(1), Scorer([], []), "c" * 16)
    assert [(version, score.mean) for version, score in evaluator.history] == [(0, 0.1), (11, 0.5)]
    assert evaluator.due(25) == 21  # v11 is done, not skipped


def test_a_version_the_proxy_could_not_load_is_skipped_said_and_unloaded_all_the_same(tmp_path, capsys):
    """The evaluation slot is freed whatever happened to the load (the proxy may finish one this side gave up on)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls: list[tuple[str, dict]] = []

    class Proxy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            calls.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            refused = self.path.endswith("/load")
            self.send_response(502 if refused else 200)
            self.end_headers()
            self.wfile.write(b"proxy: loading failed on 1/2 replicas" if refused else b"ok")

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        evaluator = RunEvaluator(
            spec(tmp_path), LocalStore(tmp_path / "store"), url, prompts(1), Scorer([], []), "d" * 16
        )
        evaluator.evaluate(11)
    finally:
        server.shutdown()
    assert calls == [("/proxy/evaluation/load", {"version": 11}), ("/proxy/evaluation/unload", {"version": 11})]
    said = json.loads(capsys.readouterr().out)
    assert said["level"] == "warning" and "v11 skipped: the proxy could not load v11: 502" in said["message"]
    assert evaluator.history == []
