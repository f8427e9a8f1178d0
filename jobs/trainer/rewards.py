"""Reward functions: the built-ins, user code, weights, and failures reported instead of swallowed.

TRL calls each reward once per group with keyword arguments (`prompts`, `completions`, `completion_ids` and every
dataset column) and sums the returned lists *unweighted*. It runs them in a spawned child process, so every reward
here is a picklable callable instance; user code travels as source text and is compiled in the child on first call.

A reward that raises, returns the wrong length, returns something that is not a number or does not answer within
its deadline does not kill the run: the rows it could not score get `None` (TRL leaves them out of the group's
advantage), and the failure — reward name, row, error — is appended to an error log the trainer forwards to the
panel. A reward that keeps failing on every row for a while does stop the run, with its last error, because training
on nothing is worse than stopping.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, cast

from jobs.contract import RewardSpec

Messages = list[dict[str, Any]]
# What TRL passes a reward: one completion per row (a message list, or a string from tests and the sandbox) and,
# where it has them, each completion's token ids.
Completions = Sequence[Messages | str]
CompletionIds = Sequence[Sequence[int]] | None
RewardFn = Callable[..., Sequence[float | None]]
# Consecutive calls in which a reward scored no row at all before the run is stopped.
MAX_CONSECUTIVE_FAILED_CALLS = 25
# Seconds one call (one group of completions) may take. A call past it scores nothing and is reported; it cannot be
# interrupted (it runs in a thread), so one that never returns keeps its thread, and a reward that keeps timing out
# stops the run like any reward that keeps failing.
REWARD_DEADLINE_S = 60.0


def completion_text(completion: Messages | str) -> str:
    """The assistant text of one completion (TRL passes message lists; tests and sandboxes may pass strings)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion if message.get("role") == "assistant")


# --- built-ins ---------------------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """The content of the last brace-balanced `\\boxed{...}` in `text`, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, position = 0, start + len("\\boxed")
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[position + 1 : index]
    return None


_LATEX_DROPS = (
    r"\$",
    r"\left",
    r"\right",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\quad",
    r"\qquad",
    "$",
    r"\%",
    "%",
    r"^\circ",
    r"^{\circ}",
    r"\displaystyle",
    "\\ ",
)


def normalize_answer(answer: str) -> str:
    """Normalise a LaTeX answer the way the public recipe's boxed reward does, so equivalent forms compare equal."""
    text = answer.strip()
    text = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", text)
    for token in _LATEX_DROPS:
        text = text.replace(token, "")
    text = text.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)  # \frac12 -> \frac{1}{2}
    text = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", text)  # \frac{a}2 -> \frac{a}{2}
    text = re.sub(r"(\d),(\d{3})", r"\1\2", text)  # thousands separators
    text = re.sub(r"\s+", "", text)
    text = text.rstrip(".")
    text = re.sub(r"^(-?\d+)\.0+$", r"\1", text)  # 5.0 -> 5
    return text


def import_builtin_dependencies(names: Sequence[str]) -> None:
    """Import what the built-in rewards `names` use, before the reward sandbox forbids loading C libraries (sympy,
    under math_verify, does with ctypes); it takes a second or two, so only for `math_boxed`."""
    if "math_boxed" in names:
        import math_verify  # noqa: F401


def symbolically_equal(answer: str, gold: str) -> bool:
    """Whether math_verify finds two LaTeX answers equal (`\\frac{1}{2}` and `0.5`, `2\\sqrt{2}` and `\\sqrt{8}`).

    math_verify's own timeouts use SIGALRM, which only works on the main thread, and TRL calls rewards off it: they
    are off here, and `CheckedReward`'s deadline bounds the whole call instead.
    """
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its timeouts are off
    try:
        expected, found = parse(f"${gold}$", parsing_timeout=None), parse(f"${answer}$", parsing_timeout=None)
        return bool(expected and found and verify(expected, found, timeout_seconds=None))
    except Exception:  # an answer sympy cannot read is simply not equal
        return False


class MathBoxed:
    """1.0 when the last `\\boxed{}` equals the gold answer, else 0.0: equal after normalisation, or, where the
    normalised strings differ, equal for math_verify, as the recipe's reward decides.

    A truncated completion (no EOS, i.e. it hit the length cap) scores 0 whatever it contains, as in the recipe:
    otherwise the policy learns to ramble until the cap and box a guess.
    """

    __name__ = "math_boxed"

    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(
        self,
        completions: Completions,
        completion_ids: CompletionIds = None,
        answer: Sequence[object] | None = None,
        **_: object,
    ) -> list[float]:
        answers = answer if answer is not None else [None] * len(completions)
        scores: list[float] = []
        for index, (completion, gold) in enumerate(zip(completions, answers, strict=True)):
            ids = completion_ids[index] if completion_ids is not None else None
            if self.eos_token_ids and ids is not None and (not ids or ids[-1] not in self.eos_token_ids):
                scores.append(0.0)
                continue
            boxed = last_boxed(completion_text(completion))
            if boxed is None or gold is None:
                scores.append(0.0)
                continue
            gold_text = last_boxed(str(gold)) or str(gold)
            equal = normalize_answer(boxed) == normalize_answer(gold_text) or symbolically_equal(boxed, gold_text)
            scores.append(1.0 if equal else 0.0)
        return scores


class FormatTags:
    """The fraction of the required tags that appear, in order (e.g. `<think>`, `</think>`, `<answer>`)."""

    __name__ = "format"

    def __init__(self, tags: Sequence[str] = ("<think>", "</think>", "<answer>", "</answer>")):
        if not tags:
            raise ValueError("format: give at least one tag")
        self.tags = list(tags)

    def __call__(self, completions: Completions, **_: object) -> list[float]:
        scores: list[float] = []
        for completion in completions:
            text, position, found = completion_text(completion), 0, 0
            for tag in self.tags:
                index = text.find(tag, position)
                if index < 0:
                    break
                found, position = found + 1, index + len(tag)
            scores.append(found / len(self.tags))
        return scores


class LengthTarget:
    """Closeness of the completion length (in tokens) to a target: 1 at the target, falling linearly to 0 at 2x."""

    __name__ = "length"

    def __init__(self, target: int = 256):
        if int(target) < 1:
            raise ValueError("length: target must be a positive number of tokens")
        self.target = int(target)

    def __call__(self, completions: Completions, completion_ids: CompletionIds = None, **_: object) -> list[float]:
        lengths = (
            [len(ids) for ids in completion_ids]
            if completion_ids is not None
            else [len(completion_text(c).split()) for c in completions]
        )
        return [max(0.0, 1.0 - abs(length - self.target) / self.target) for length in lengths]


class RegexMatch:
    """1.0 when the completion matches a regular expression (searched anywhere), else 0.0."""

    __name__ = "regex"

    def __init__(self, pattern: str):
        try:
            self.regex = re.compile(pattern, re.S)
        except re.error as error:
            raise ValueError(f"regex: pattern {pattern!r} does not compile: {error}") from None

    def __getstate__(self) -> dict[str, str]:
        return {"pattern": self.regex.pattern}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.regex = re.compile(state["pattern"], re.S)

    def __call__(self, completions: Completions, **_: object) -> list[float]:
        return [1.0 if self.regex.search(completion_text(c)) else 0.0 for c in completions]


class DigitFraction:
    """The demo reward: the fraction of completion tokens that are digits.

    The demo tokenizer splits digits into single tokens, so digit characters over completion tokens is exactly that
    fraction. Dense from the first step (about 0.02 for an untrained model), which group-relative advantages need.
    """

    __name__ = "digit_frac"

    def __call__(self, completions: Completions, completion_ids: CompletionIds = None, **_: object) -> list[float]:
        scores: list[float] = []
        for index, completion in enumerate(completions):
            text = completion_text(completion)
            tokens = len(completion_ids[index]) if completion_ids is not None else len(text)
            scores.append(min(1.0, sum(ch.isdigit() for ch in text) / tokens) if tokens else 0.0)
        return scores


class ExactAnswer:
    """1.0 when the final reply, trimmed, is the gold answer, else 0.0: for agents, whose last turn answers once the
    tools have been asked (earlier turns and tool results are not the answer)."""

    __name__ = "exact_answer"

    def __call__(self, completions: Completions, answer: Sequence[object] | None = None, **_: object) -> list[float]:
        answers = answer if answer is not None else [None] * len(completions)
        return [
            1.0 if gold is not None and final_reply(completion).strip() == str(gold).strip() else 0.0
            for completion, gold in zip(completions, answers, strict=True)
        ]


def final_reply(completion: Messages | str) -> str:
    """The text of a completion's last assistant message (the whole text for a plain string)."""
    if isinstance(completion, str):
        return completion
    replies = [message for message in completion if message.get("role") == "assistant"]
    return str(replies[-1].get("content") or "") if replies else ""


def _builtin(spec: RewardSpec, eos_token_ids: Sequence[int]) -> RewardFn:
    params: dict[str, Any] = dict(spec.params)  # JSON values each reward's constructor checks (or fails on)
    if spec.name == "math_boxed":
        return MathBoxed(eos_token_ids)
    if spec.name == "format":
        return FormatTags(**params)
    if spec.name == "length":
        return LengthTarget(**params)
    if spec.name == "regex":
        if "pattern" not in params:
            raise ValueError("regex: needs a 'pattern' parameter")
        return RegexMatch(**params)
    if spec.name == "digit_frac":
        return DigitFraction()
    if spec.name == "exact_answer":
        return ExactAnswer()
    raise ValueError(f"unknown built-in reward {spec.name!r}")


# --- user code ---------------------------------------------------------------------------------------------------


class UserCode:
    """A reward defined by user source code, compiled where it runs (the picklable form is just the text)."""

    def __init__(self, source: str, entry_point: str, name: str):
        self.source, self.entry_point, self.__name__ = source, entry_point, name
        self._fn: RewardFn | None = None

    def __getstate__(self) -> dict[str, str]:
        return {"source": self.source, "entry_point": self.entry_point, "__name__": self.__name__}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.source, self.entry_point, self.__name__ = state["source"], state["entry_point"], state["__name__"]
        self._fn = None

    def load(self) -> RewardFn:
        """Compile the source and find the entry point; raises ValueError that names the reward on any problem."""
        if self._fn is None:
            namespace: dict[str, Any] = {"__name__": f"reward_{self.__name__}"}
            try:
                exec(compile(self.source, f"<reward {self.__name__}>", "exec"), namespace)
            except SyntaxError as error:
                raise ValueError(f"reward {self.__name__}: syntax error on line {error.lineno}: {error.msg}") from None
            except Exception as error:
                raise ValueError(
                    f"reward {self.__name__}: the code failed when loaded: {type(error).__name__}: {error}"
                ) from None
            fn = namespace.get(self.entry_point)
            if not callable(fn):
                raise ValueError(f"reward {self.__name__}: the code defines no function named {self.entry_point!r}")
            self._fn = fn
        return self._fn

    def __call__(self, **kwargs: Any) -> Sequence[float | None]:
        return self.load()(**kwargs)


# --- the wrapper TRL actually calls ----------------------------------------------------------------------------


class RewardErrorRecord(TypedDict):
    """One line of the reward error log: written in TRL's rollout child (`CheckedReward`), read by the trainer
    process (`telemetry.RewardErrorForwarder`)."""

    time: float
    reward: str
    error: str
    row: dict[str, Any]  # `_row_preview`: the row's index, completion and dataset columns, shortened
    trace: str


class RewardError(RuntimeError):
    """A reward failed on every row for too long; the run stops with this message."""


class InvalidScore(ValueError):
    def __init__(self, index: int, message: str):
        super().__init__(f"row {index}: {message}")
        self.index = index


class CheckedReward:
    """Validates, weights and reports one reward function.

    `error_log` is a JSONL file the trainer process tails (this object runs in TRL's child process).
    """

    def __init__(
        self,
        fn: RewardFn,
        name: str,
        weight: float = 1.0,
        error_log: str | None = None,
        deadline: float = REWARD_DEADLINE_S,
    ):
        self.fn, self.__name__, self.weight, self.error_log = fn, name, float(weight), error_log
        self.deadline = deadline
        self._failed_calls = 0

    def score(self, completions: Completions, **kwargs: Any) -> list[float | None]:
        """Weighted scores, raising on any problem (the reward sandbox shows these errors as they are)."""
        scores = self._validate(self.fn(completions=completions, **kwargs), len(completions))
        return [None if score is None else score * self.weight for score in scores]

    async def __call__(self, completions: Completions, **kwargs: Any) -> list[float | None]:
        """What TRL awaits: `score` in a worker thread, within `deadline` seconds; a failure or a call past the
        deadline is reported and scores nothing instead of raising. (Async so that TRL awaits it: a plain callable
        it would run in a thread with no deadline at all.)"""
        try:
            scores = await asyncio.wait_for(asyncio.to_thread(self.score, completions, **kwargs), self.deadline)
            self._failed_calls = 0
            return scores
        except TimeoutError:
            error = TimeoutError(f"did not answer within {self.deadline:g} s; its scores were left out")
            return self._failed(error, completions, kwargs)
        except Exception as error:
            return self._failed(error, completions, kwargs)

    def _failed(self, error: Exception, completions: Completions, kwargs: dict[str, Any]) -> list[float | None]:
        """Report a failed call; stop the run once the reward has failed too many calls in a row."""
        self._failed_calls += 1
        self._report(error, _row_preview(completions, kwargs, getattr(error, "index", 0)))
        if self._failed_calls >= MAX_CONSECUTIVE_FAILED_CALLS:
            raise RewardError(
                f"reward {self.__name__} failed on {self._failed_calls} consecutive groups, last with "
                f"{type(error).__name__}: {error}; fix the reward and relaunch"
            ) from None
        return [None] * len(completions)

    @staticmethod
    def _validate(raw: Any, expected: int) -> list[float | None]:
        if not isinstance(raw, list | tuple):
            raise TypeError(f"returned {type(raw).__name__}, expected a list of {expected} numbers")
        if len(raw) != expected:
            raise ValueError(f"returned {len(raw)} scores for {expected} completions")
        scores: list[float | None] = []
        for index, value in enumerate(raw):
            if value is None:  # TRL's "cannot score this row" (e.g. an unparseable gold answer)
                scores.append(None)
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidScore(index, f"returned {type(value).__name__} {str(value)[:40]!r}, expected a number")
            elif not math.isfinite(value):
                raise InvalidScore(index, f"returned {value}, expected a finite number")
            else:
                scores.append(float(value))
        return scores

    def _report(self, error: BaseException, row: dict[str, Any]) -> None:
        if not self.error_log:
            return
        record: RewardErrorRecord = {
            "time": time.time(),
            "reward": self.__name__,
            "error": f"{type(error).__name__}: {error}",
            "row": row,
            "trace": traceback.format_exc(limit=3)[-1500:],
        }
        try:
            with open(self.error_log, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError:
            pass


def _row_preview(completions: Completions, kwargs: dict[str, Any], index: int) -> dict[str, Any]:
    preview: dict[str, Any] = {"index": index}
    if completions:
        preview["completion"] = completion_text(completions[index])[:300]
    for key, values in kwargs.items():
        if key in ("prompts", "completion_ids") or not isinstance(values, list) or len(values) <= index:
            continue
        preview[key] = str(values[index])[:200]
    return preview


def build_rewards(
    specs: Sequence[RewardSpec], eos_token_ids: Sequence[int] = (), error_log: str | os.PathLike[str] | None = None
) -> list[CheckedReward]:
    """The reward callables for a run, in spec order. Built-in parameters are checked here, before training."""
    rewards: list[CheckedReward] = []
    for spec in specs:
        # RewardSpec's validator requires source and entry_point for kind "code".
        fn = (
            _builtin(spec, eos_token_ids)
            if spec.kind == "builtin"
            else UserCode(cast(str, spec.source), cast(str, spec.entry_point), spec.name)
        )
        if isinstance(fn, UserCode):
            fn.load()  # fail now, with the reward's name, rather than in the rollout child
        rewards.append(CheckedReward(fn, spec.name, spec.weight, str(error_log) if error_log else None))
    return rewards
