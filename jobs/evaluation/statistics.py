"""Scores summarised so that two versions can be told apart honestly: a mean with its 95 % interval, unbiased
pass@k for 0/1 scores, and a paired comparison of two versions on the same prompts.

The unit is the prompt: a prompt's k samples are not independent draws of the eval set, so each prompt's scores are
averaged first and the interval is over prompts (Student's t, as the number of prompts can be small).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev

# Student's t, two-sided 95 %, for 1..30 degrees of freedom; beyond, the normal quantile is within 2 %.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
TIE = 1e-9  # per-prompt means closer than this are a tie


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


@dataclass(frozen=True)
class Paired:
    """Version b against version a on the same prompts: the mean difference (b - a) with its interval, and per
    prompt how often b's mean score was higher, equal or lower."""

    difference: Interval
    wins: int
    ties: int
    losses: int


def t95(degrees: int) -> float:
    if degrees < 1:
        return math.inf
    return _T95[degrees - 1] if degrees <= len(_T95) else NormalDist().inv_cdf(0.975)


def interval(values: Sequence[float]) -> Interval:
    """The mean of `values` with its 95 % interval (a single value: an unbounded one)."""
    if not values:
        raise ValueError("no values to summarise")
    mean = fmean(values)
    if len(values) == 1:
        return Interval(mean, -math.inf, math.inf)
    half = t95(len(values) - 1) * stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half)


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The unbiased estimator of pass@k from `samples` draws of which `correct` passed (Chen et al., 2021):
    1 - C(samples - correct, k) / C(samples, k)."""
    if not 0 <= correct <= samples or not 1 <= k <= samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= samples ({samples}) and 0 <= correct <= samples")
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def is_binary(scores: Sequence[Sequence[float]]) -> bool:
    return all(score in (0.0, 1.0) for prompt in scores for score in prompt)


def paired(a: Sequence[float], b: Sequence[float]) -> Paired:
    """Compare per-prompt mean scores `b` against `a` (the same prompts, in the same order)."""
    if len(a) != len(b):
        raise ValueError(f"paired scores need the same prompts: {len(a)} against {len(b)}")
    differences = [y - x for x, y in zip(a, b, strict=True)]
    wins = sum(d > TIE for d in differences)
    losses = sum(d < -TIE for d in differences)
    return Paired(interval(differences), wins, len(differences) - wins - losses, losses)


def stalled(history: Sequence[tuple[int, Interval]], patience: int) -> int | None:
    """The version whose held-out score the last `patience` evaluations did not beat by more than its interval (none
    scored above its upper bound), or None while scores still improve. `history` is (version, score) in the order
    evaluated."""
    if not history:
        return None
    best = 0
    for index in range(1, len(history)):
        if history[index][1].mean > history[best][1].high:
            best = index
    if not math.isfinite(history[best][1].high):  # one prompt: no interval, nothing can be said to stall
        return None
    return history[best][0] if len(history) - 1 - best >= patience else None
