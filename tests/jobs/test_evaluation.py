"""Held-out evaluation's parts (issue 29): the eval settings, which prompts are held out, and the statistics.

The evaluation of a real run's versions is in tests/test_e2e_demo.py (`test_held_out_evaluation_...`); the refusals
of bad eval settings in tests/test_bad_input.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from jobs.contract import SpecError
from jobs.demo.preset import demo_spec
from jobs.evaluation.heldout import carve, held_out, normalise, training_rows
from jobs.evaluation.results import VersionEval
from jobs.evaluation.sampling import Sampling
from jobs.evaluation.statistics import interval, paired, pass_at_k, t95
from jobs.store import LocalStore
from jobs.trainer.dataset import DatasetError, load_rows

# --- statistics, against hand-computed examples ---------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    with pytest.raises(ValueError, match="k <= samples"):
        pass_at_k(4, 1, 5)


def test_the_interval_is_students_t_over_prompts():
    summary = interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182 * 1.2909944 / 2  # t(3) * sample sd / sqrt(4)
    assert summary.mean == 2.5
    assert (summary.low, summary.high) == pytest.approx((2.5 - half, 2.5 + half), abs=1e-4)
    assert t95(1) == 12.706 and t95(200) == pytest.approx(1.96, abs=1e-3)
    alone = interval([0.7])
    assert alone.mean == 0.7 and math.isinf(alone.half_width)
    with pytest.raises(ValueError):
        interval([])


def test_the_paired_comparison_counts_wins_ties_and_losses_per_prompt():
    a, b = [0.1, 0.5, 0.5, 0.0], [0.3, 0.5, 0.2, 1.0]
    comparison = paired(a, b)
    assert (comparison.wins, comparison.ties, comparison.losses) == (2, 1, 1)
    assert comparison.difference.mean == pytest.approx((0.2 + 0.0 - 0.3 + 1.0) / 4)
    assert comparison.difference.low < comparison.difference.mean < comparison.difference.high
    with pytest.raises(ValueError, match="same prompts"):
        paired([0.1], [0.1, 0.2])


def version_eval(scores: dict[str, list[list[float]]]) -> VersionEval:
    """A version's evaluation with these scores (per function, per prompt, per sample) on made-up prompts."""
    prompts, k = len(next(iter(scores.values()))), len(next(iter(scores.values()))[0])
    return VersionEval(
        run_id="eval-test",
        version=7,
        key="0123456789abcdef",
        source="split 'test'",
        sampling={"k": k},
        k=k,
        prompts=[f"p{i}" for i in range(prompts)],
        completions=[["text"] * k] * prompts,
        scores=scores,
        seconds=1.5,
    )


def test_a_result_summarises_per_prompt_and_reports_pass_at_k_only_for_0_1_scores():
    scores = {"exact": [[1.0, 0.0, 0.0, 0.0], [0.0] * 4], "shaped": [[0.5, 0.25, 0.0, 0.25], [1.0] * 4]}
    result = version_eval(scores)
    exact, shaped = result.summary("exact"), result.summary("shaped")
    assert exact.per_prompt == [0.25, 0.0] and exact.pass_at_k == 0.5  # the first prompt passed once in 4
    assert shaped.per_prompt == [0.25, 1.0] and shaped.pass_at_k is None
    assert shaped.avg.mean == pytest.approx(0.625)
    assert VersionEval.from_json(result.to_json()) == result


# --- settings ---------------------------------------------------------------------------------------------------


def spec(tmp_path: Path, **sections: Any):
    return demo_spec("eval-test", f"file://{tmp_path / 'store'}", **sections)


def test_the_demo_evaluates_on_its_test_split_and_the_recipe_does_not(tmp_path):
    from backend.launch.presets import math_recipe

    assert spec(tmp_path).eval.split == "test" and spec(tmp_path).eval.enabled
    assert not demo_spec("x-y", "file:///tmp/s", dataset={"source": "store", "id": "d/a.jsonl"}).eval.enabled
    from jobs.contract import parse_spec

    assert not parse_spec(math_recipe("math-1", "me", "bucket")).eval.enabled


EXACT = {"kind": "code", "name": "exact", "entry_point": "exact", "source": "def exact(completions, **kw): ..."}


@pytest.mark.parametrize(
    ("settings", "field", "words"),
    [
        ({"split": "test", "holdout": 8}, "eval.holdout", "not both"),
        ({"split": "test", "greedy": True, "k": 4}, "eval.k", "set k to 1"),
        ({"split": "train"}, "eval.split", "the split the run trains on"),
        ({"split": "test", "k": 0}, "eval.k", "greater than or equal to 1"),
        ({"split": "test", "prompts": 5000}, "eval.prompts", "less than or equal to 4096"),
        ({"split": "test", "metrics": [EXACT, EXACT]}, "eval.metrics", "distinct name"),
        ({"split": "test", "metrics": [{**EXACT, "weight": 2.0}]}, "eval.metrics.0.weight", "never weighted"),
        ({"metrics": [EXACT]}, "eval.metrics", "set a held-out split or held-out rows"),
        ({"split": "test", "metrics": [{"name": "digit_frac"}]}, "eval.metrics.0.name", "already a reward"),
        ({"split": "test", "metrics": [{**EXACT, "source": ""}]}, "eval.metrics.0.source", "needs Python code"),
    ],
)
def test_eval_settings_that_cannot_work_are_named(tmp_path, settings, field, words):
    with pytest.raises(SpecError) as refused:
        spec(tmp_path, eval=settings)
    assert words in refused.value.errors[field], refused.value.errors


def test_an_empty_split_means_no_evaluation(tmp_path):
    assert not spec(tmp_path, eval={"split": "  "}).eval.enabled


def test_the_run_samples_as_it_trains_unless_greedy(tmp_path):
    sampled = Sampling.of(spec(tmp_path, grpo={"temperature": 0.7}))
    assert (sampled.k, sampled.temperature, sampled.max_tokens) == (4, 0.7, 16)
    greedy = Sampling.of(spec(tmp_path, eval={"split": "test", "greedy": True, "k": 1}))
    assert (greedy.k, greedy.temperature) == (1, 0.0)
    # Each (prompt, sample) its own seed: prompt 2's four samples start at seed + 8 (the CPU engine adds the choice).
    assert [sampled.request("m", [1], index)["seed"] for index in range(3)] == [0, 4, 8]


# --- which prompts are held out -------------------------------------------------------------------------------------


def test_carving_is_seeded_disjoint_and_leaves_rows_to_train_on():
    train, held = carve(32, 8, seed=3)
    assert (train, held) == carve(32, 8, seed=3) and held != carve(32, 8, seed=4)[1]
    assert len(held) == 8 and not set(train) & set(held) and sorted(train + held) == list(range(32))
    with pytest.raises(DatasetError, match="eval.holdout: 32 held-out rows would leave none"):
        carve(32, 32, seed=0)


def test_the_demo_holds_out_its_test_split_with_no_prompt_shared():
    held = held_out(spec(Path("/nonexistent")))
    assert len(held.rows) == 32 and (held.candidates, held.shared) == (32, 0)
    assert all(" forest" in row["prompt"] or row["prompt"].split()[-1] in "window garden candle" for row in held.rows)
    assert held.fingerprint == held_out(spec(Path("/nonexistent"))).fingerprint


def write_rows(store: Path, prompts: list[str]) -> str:
    path = store / "datasets" / "rows.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f'{{"prompt": "{prompt}", "answer": "1"}}\n' for prompt in prompts))
    return "datasets/rows.jsonl"


def test_carved_rows_never_reach_the_trainer_and_shared_prompts_are_dropped_and_counted(tmp_path):
    """The rows the trainer is given (what jobs/trainer/job.py calls) hold none of the evaluated prompts, and a
    carved prompt that also occurs among the training rows (here with other whitespace) is not evaluated."""
    prompts = [f"question {i}" for i in range(20)] + ["question  3", " question 7 "]
    dataset = {"source": "store", "id": write_rows(tmp_path / "store", prompts), "prompt_column": "prompt"}
    run = spec(tmp_path, dataset=dataset, eval={"holdout": 10, "seed": 1})
    store = LocalStore(tmp_path / "store")
    held = held_out(run, store)
    trained = [row["prompt"] for row in training_rows(load_rows(run.dataset, store), run.eval)]
    assert len(trained) == len(prompts) - 10
    evaluated = {normalise(row["prompt"]) for row in held.rows}
    assert not evaluated & {normalise(prompt) for prompt in trained}
    assert held.candidates == 10 and held.shared == 10 - len(held.rows) and held.shared >= 1, held
    assert normalise("  a\tb\n c ") == "a b c"


def test_an_eval_set_with_every_prompt_shared_is_refused_with_the_count(tmp_path):
    dataset = {"source": "store", "id": write_rows(tmp_path / "store", ["same prompt"] * 12), "prompt_column": "prompt"}
    run = spec(tmp_path, dataset=dataset, eval={"holdout": 4})
    with pytest.raises(DatasetError, match="eval.holdout: all 4 held-out prompts .* also occur in the training rows"):
        held_out(run, LocalStore(tmp_path / "store"))


def test_at_most_the_asked_number_of_prompts_is_evaluated(tmp_path):
    held = held_out(spec(tmp_path, eval={"split": "test", "prompts": 5}))
    assert len(held.rows) == 5 and held.candidates == 32
    again = held_out(spec(tmp_path, eval={"split": "test", "prompts": 5}))
    assert again.rows == held.rows  # the same 5, drawn with the eval seed


def test_the_model_card_carries_the_held_out_scores_as_the_hub_reads_them(tmp_path):
    from huggingface_hub import ModelCard

    from backend.services.adapters import model_card

    per_prompt = [[0.5, 0.7], [0.2, 0.4], [0.9, 0.9]]
    held_out = version_eval({"reward": per_prompt, "rewards/digit_frac": per_prompt})
    card = model_card(spec(tmp_path), 7, 6, {"reward": 0.5}, held_out)
    assert "On 3 prompts it never trained on (split 'test'), 2 samples each" in card
    results = {result.metric_type: result for result in ModelCard(card).data.eval_results}
    assert results["reward"].metric_value == pytest.approx(0.6, abs=1e-4)
    assert (results["reward"].dataset_name, results["reward"].dataset_split) == ("digits", "test")
    assert "model-index" not in model_card(spec(tmp_path), 7, 6, {"reward": 0.5})
