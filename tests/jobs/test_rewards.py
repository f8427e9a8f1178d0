"""Built-in rewards on real examples, user code, weights, and failures reported with the reward's name and row."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jobs.contract import BUILTIN_REWARDS, RewardSpec
from jobs.trainer.rewards import (
    MAX_CONSECUTIVE_FAILED_CALLS,
    CheckedReward,
    DigitFraction,
    ExactAnswer,
    FormatTags,
    LengthTarget,
    MathBoxed,
    RegexMatch,
    RewardError,
    build_rewards,
    last_boxed,
    normalize_answer,
    symbolically_equal,
)
from tests.support.waiting import wait_until

EOS = 2


def awaited(call):
    """Run an awaitable reward call to its end on a loop of its own (in a thread: the suite's thread may have one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, call).result()


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_last_boxed_is_brace_balanced_and_takes_the_last():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{unclosed") is None


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\left(1,2\right)", "(1,2)"),
        ("1,000", "1000"),
        ("5.0", "5"),
        (r"90^\circ", "90"),
        (r"\$42", "42"),
        (r"\text{ 7 }", "7"),
        ("x = 3.", "x=3"),
    ],
)
def test_normalisation_makes_equivalent_answers_equal(predicted, gold):
    assert normalize_answer(predicted) == normalize_answer(gold)


def test_math_boxed_scores_the_last_box_and_zeroes_truncated_completions():
    reward = MathBoxed(eos_token_ids=[EOS])
    completions = [
        assistant(r"so the answer is \boxed{\dfrac{1}{2}}"),
        assistant(r"\boxed{3} no wait \boxed{4}"),
        assistant(r"\boxed{\frac{1}{2}}"),  # right answer but truncated (no EOS)
        assistant("I don't know"),
    ]
    ids = [[5, 6, EOS], [5, EOS], [5, 6, 7], [5, EOS]]
    gold = [r"\frac{1}{2}", "3", r"\frac{1}{2}", "1"]
    assert reward(completions=completions, completion_ids=ids, answer=gold) == [1.0, 0.0, 0.0, 0.0]


def test_math_boxed_reads_a_boxed_gold_answer():
    reward = MathBoxed()
    assert reward(completions=[assistant(r"\boxed{12}")], answer=[r"The answer is $\boxed{12}$."]) == [1.0]


def test_format_counts_tags_in_order():
    reward = FormatTags(["<think>", "</think>", "<answer>", "</answer>"])
    scores = reward(
        completions=[
            assistant("<think>x</think><answer>1</answer>"),
            assistant("<answer>1</answer><think>"),
            assistant("nothing"),
        ]
    )
    assert scores == [1.0, 0.25, 0.0]


def test_length_peaks_at_the_target():
    reward = LengthTarget(target=4)
    assert reward(completions=[None] * 4, completion_ids=[[1] * 4, [1] * 2, [1] * 8, [1] * 12]) == [1.0, 0.5, 0.0, 0.0]


def test_regex_matches_anywhere_and_pickles():
    reward = pickle.loads(pickle.dumps(RegexMatch(r"\d{3}")))
    assert reward(completions=[assistant("code 123 here"), assistant("12")]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="does not compile"):
        RegexMatch("(unclosed")


def test_digit_fraction_counts_digit_tokens():
    reward = DigitFraction()
    scores = reward(completions=[assistant("12 apples"), assistant("none")], completion_ids=[[1, 2, 3, 4], [1, 2]])
    assert scores == [0.5, 0.0]


def test_exact_answer_scores_an_agents_final_reply_not_its_tool_turns():
    """The agent demo's reward: the episode's last reply is the answer; what a tool said earlier is not."""
    episode = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {}}}]},
        {"role": "tool", "name": "lookup", "content": "7"},
        {"role": "assistant", "content": " 7\n"},
    ]
    guessed = [{"role": "assistant", "content": "3"}]
    copied_wrong = [*episode[:2], {"role": "assistant", "content": "7 or 8"}]
    scores = ExactAnswer()(completions=[episode, guessed, copied_wrong, "7"], answer=["7", "7", "7", "7"])
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert ExactAnswer()(completions=[episode]) == [0.0]  # no gold answer: nothing to match


def test_every_builtin_in_the_contract_builds():
    params = {"regex": {"pattern": "x"}, "format": {"tags": ["<a>"]}, "length": {"target": 5}}
    specs = [RewardSpec(name=name, params=params.get(name, {})) for name in BUILTIN_REWARDS]
    rewards = build_rewards(specs, [EOS])
    assert [r.__name__ for r in rewards] == list(BUILTIN_REWARDS)
    pickle.dumps(rewards)  # TRL ships them to a spawned child


SOURCE = """
def score(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]
"""


def test_user_code_runs_is_weighted_and_pickles():
    spec = RewardSpec(kind="code", name="contains", source=SOURCE, entry_point="score", weight=2.0)
    (reward,) = build_rewards([spec])
    reward = pickle.loads(pickle.dumps(reward))
    assert reward.__name__ == "contains"
    assert awaited(reward(completions=[assistant("x 7"), assistant("x")], answer=["7", "7"])) == [2.0, 0.0]


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("def score(:\n  pass", "syntax error on line 1"),
        ("raise RuntimeError('at import')", "failed when loaded"),
        ("x = 1", "no function named 'score'"),
    ],
)
def test_user_code_problems_name_the_reward(source, fragment):
    spec = RewardSpec(kind="code", name="mine", source=source, entry_point="score")
    with pytest.raises(ValueError, match=fragment) as raised:
        build_rewards([spec])
    assert "reward mine" in str(raised.value)


@pytest.mark.parametrize(
    ("returns", "fragment"),
    [
        ("[1.0]", "returned 1 scores for 2 completions"),
        ("[1.0, 'high']", "row 1: returned str"),
        ("[float('nan'), 1.0]", "row 0: returned nan"),
        ("0.5", "returned float, expected a list"),
        ("[1/0, 1]", "ZeroDivisionError"),
    ],
)
def test_bad_returns_are_reported_with_name_and_row_without_killing(tmp_path, returns, fragment):
    log = tmp_path / "errors.jsonl"
    source = f"def score(completions, **kw):\n    return {returns}\n"
    (reward,) = build_rewards([RewardSpec(kind="code", name="bad", source=source, entry_point="score")], error_log=log)
    assert awaited(reward(completions=[assistant("a"), assistant("b")], answer=["1", "2"])) == [None, None]
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["reward"] == "bad" and fragment in record["error"]
    assert "completion" in record["row"] and "answer" in record["row"]


def test_a_reward_that_always_fails_stops_the_run_after_a_while(tmp_path):
    def broken(completions, **kw):
        raise KeyError("answer")

    reward = CheckedReward(broken, "broken", error_log=str(tmp_path / "e.jsonl"))
    for _ in range(MAX_CONSECUTIVE_FAILED_CALLS - 1):
        assert awaited(reward(completions=[assistant("a")])) == [None]
    with pytest.raises(RewardError, match="broken failed on"):
        awaited(reward(completions=[assistant("a")]))


def test_returning_none_on_purpose_is_not_a_failure(tmp_path):
    def unsure(completions, **kw):
        return [None] * len(completions)

    reward = CheckedReward(unsure, "unsure", error_log=str(tmp_path / "e.jsonl"))
    for _ in range(MAX_CONSECUTIVE_FAILED_CALLS + 5):
        assert awaited(reward(completions=[assistant("a")])) == [None]
    assert not (tmp_path / "e.jsonl").exists()


def test_a_reward_past_its_deadline_scores_nothing_and_is_reported_by_name(tmp_path):
    """Issue 13: every call has a deadline; TRL awaits the reward (its own helper says so), so a reward that hangs
    costs one group's scores, not the run."""
    from trl.trainer.utils import is_async_callable

    release = threading.Event()

    def hangs(completions, **kw):
        release.wait(30)
        return [1.0] * len(completions)

    errors = tmp_path / "e.jsonl"
    reward = CheckedReward(hangs, "slow_judge", error_log=str(errors), deadline=0.2)
    assert is_async_callable(reward)
    with ThreadPoolExecutor(1) as pool:
        scores = pool.submit(asyncio.run, reward(completions=[assistant("a"), assistant("b")], answer=["1", "2"]))
        try:
            # The call is given up once its error is recorded; only then is the hung reward let go (the loop's
            # shutdown waits for its thread, as TRL's long-lived loop would not).
            wait_until(errors.exists, 30, what="the reward's deadline recorded")
        finally:
            release.set()
        assert scores.result() == [None, None]
    record = json.loads(errors.read_text().splitlines()[-1])
    assert record["reward"] == "slow_judge"
    assert record["error"] == "TimeoutError: did not answer within 0.2 s; its scores were left out"
    quick = CheckedReward(lambda completions, **kw: [0.5] * len(completions), "quick", deadline=0.2)
    assert awaited(quick(completions=[assistant("a")])) == [0.5]


def test_math_boxed_falls_back_to_math_verify_when_the_strings_differ():
    reward = MathBoxed(eos_token_ids=[EOS])
    completions = [assistant(r"so \boxed{\frac{1}{2}}"), assistant(r"\boxed{2\sqrt{2}}"), assistant(r"\boxed{3}")]
    gold = ["0.5", r"\sqrt{8}", "4"]
    assert reward(completions=completions, completion_ids=[[1, EOS]] * 3, answer=gold) == [1.0, 1.0, 0.0]
    assert symbolically_equal("x+1", "1+x") and not symbolically_equal("hello", "5")
