"""Held-out evaluation during a run: a process beside the trainer that scores the base model once, every Nth
adapter version as it is published, and the last one, through the proxy by each version's name.

    python -m jobs.evaluation --spec <storage uri>/runs/<run_id>/spec.json --proxy http://127.0.0.1:<port> \
        --final-file <path>

A LoRA name pins a weight version, so the score of v12 is that of v12 whatever training does meanwhile.
Each version is loaded for its evaluation under its own evaluation name (`POST /proxy/evaluation/load`, all-or-nothing
on every replica, one LoRA slot the replicas keep for it) and unloaded after, so TRL unloading the version meanwhile
takes nothing away. The evaluator never holds training up: few of its prompts are in flight at once, a version it
cannot load or sample is skipped, and when it falls behind it evaluates the newest due version and skips the rest.
Each skip and failure is one JSON line on stdout, which the trainer forwards as an event.

Every result is written twice, telemetry first: a record on the `eval` stream (what the panel ingests) and the whole
result at the key the panel's own evaluation reads (jobs/evaluation/results.py). A restarted evaluator skips the
versions whose result is stored; one that died between the two writes evaluates that version again, and the panel
keeps the first record.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from jobs.contract import RunSpec, derived, layout
from jobs.contract.control import STOP, StopRequest
from jobs.evaluation.heldout import EvalPrompts, HeldOut, eval_prompts, held_out
from jobs.evaluation.results import (
    TOTAL,
    EvalRecord,
    VersionEval,
    result_key,
    score_names,
    score_table,
    scored_functions,
    stored_result,
)
from jobs.evaluation.sampling import Completion, Sampling, SamplingError, draw
from jobs.evaluation.statistics import Interval, stalled
from jobs.runtime import add_run_arguments, open_run, setup_logging
from jobs.secrets import redact
from jobs.store import ObjectNotFound, ObjectStore, StoreError
from jobs.store.published import read_manifest
from jobs.telemetry import ChunkWriter

log = logging.getLogger("jobs.evaluation")
POLL_S = 1.0  # how often the newest published version is read
IN_FLIGHT_PROMPTS = 2  # the evaluator's prompts at the replicas at once (k samples each): training keeps the rest
LOAD_TIMEOUT_S = 900.0  # the proxy's load deadline, after its wait for a weight sync under way


@dataclass(frozen=True)
class Scorer:
    """The run's rewards, as the trainer builds them (same code, weights and EOS ids), and its eval metrics, over
    held-out completions."""

    names: list[str]  # results.score_names
    functions: list[Any]  # jobs.trainer.rewards.CheckedReward, of results.scored_functions

    def score(self, prompts: EvalPrompts, sampled: list[list[Completion]]) -> dict[str, list[list[float]]]:
        k = len(sampled[0])
        records = [record for record in prompts.records for _ in range(k)]
        completions = [c.scored() for texts in sampled for c in texts]
        ids = [c.token_ids for texts in sampled for c in texts]
        columns = {name: [record[name] for record in records] for name in records[0] if name != "prompt"}
        prompts_each = [record["prompt"] for record in records]
        kwargs = {"prompts": prompts_each, "completion_ids": ids, **columns}
        weighted = [_within_deadline(functools.partial(f.score, completions, **kwargs)) for f in self.functions]
        return score_table(self.names, weighted, k)


def _within_deadline(score: Callable[[], list[float | None]]) -> list[float | None]:
    """A reward's scores within the trainer's deadline for one call (`REWARD_DEADLINE_S`): a reward that hangs fails
    the version's evaluation instead of freezing the evaluator (its thread is left to finish, as in the trainer)."""
    from jobs.trainer.rewards import REWARD_DEADLINE_S

    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(score).result(timeout=REWARD_DEADLINE_S)
    except FutureTimeout:
        raise TimeoutError(f"a reward did not answer within {REWARD_DEADLINE_S:g} s") from None
    finally:
        pool.shutdown(wait=False)


class RunEvaluator:
    """Evaluates versions of one run through its proxy and writes their results."""

    def __init__(
        self, spec: RunSpec, store: ObjectStore, proxy_url: str, prompts: EvalPrompts, scorer: Scorer, key: str
    ):
        self.spec, self.store, self.proxy_url = spec, store, proxy_url
        self.prompts, self.scorer, self.key = prompts, scorer, key
        self.sampling = Sampling.of(spec)
        self.every = derived.eval_cost(spec, len(prompts.records)).every
        self.stream = ChunkWriter(store, spec.run_id, "eval")
        self.history = self._stored_history()  # (version, held-out reward) in the order evaluated
        self.reached = max((version for version, _ in self.history), default=0)  # due versions up to it: done
        # What an evaluator before this one (restarted) already said and did.
        self.alerted = stalled(self.history, spec.eval.patience) is not None
        self.stopped = self.alerted and spec.eval.stop_on_regression

    def due(self, published: int) -> int | None:
        """The version to evaluate next once `published` is the newest: the newest every-Nth one past those already
        reached. Older ones passed over meanwhile are skipped, said once: the evaluator catches up, never lags."""
        branch = self.spec.parent is not None
        due = [v for v in range(published, self.reached, -1) if derived.version_due(v, self.every, branch)]
        if not due:
            return None
        self.reached = due[0]
        if due[1:]:
            skipped = ", ".join(f"v{v}" for v in reversed(due[1:]))
            notice("warning", f"held-out evaluation fell behind: {skipped} skipped, v{due[0]} evaluated instead")
        return due[0]

    def evaluate(self, version: int) -> None:
        """Evaluate `version` (0: the base model) unless it is scored already; a failure is said, not raised."""
        if any(done == version for done, _ in self.history):
            return
        stored = stored_result(self.store, self.spec.run_id, version, self.key)
        if stored is not None:  # scored by the panel under the same settings: recorded, not scored again
            self._record(stored, tokens=0)
            return
        started = time.monotonic()
        try:
            with self._served(version) as model:
                sampled = draw(self.prompts, self.proxy_url, model, self.sampling, IN_FLIGHT_PROMPTS)
            scores = self.scorer.score(self.prompts, sampled)
        except SamplingError as error:
            notice("warning", f"held-out evaluation of v{version} skipped: {error}")
            return
        except Exception as error:  # the run's reward raised on a held-out completion: say which and why
            notice("warning", f"held-out evaluation of v{version} failed: {type(error).__name__}: {error}")
            return
        result = VersionEval(
            run_id=self.spec.run_id,
            version=version,
            key=self.key,
            source=self.prompts.source,
            sampling=self.sampling.describe(),
            k=self.sampling.k,
            prompts=self.prompts.texts,
            completions=[[c.text for c in texts] for texts in sampled],
            scores=scores,
            seconds=time.monotonic() - started,
        )
        self._record(result, sum(len(c.token_ids) for texts in sampled for c in texts))
        self.store.put_bytes(layout.eval_key(self.spec.run_id, version, self.key), result.to_json().encode())
        summary = result.summary(TOTAL).avg
        log.info("v%d: held-out %s %.3f in %.1f s", version, TOTAL, summary.mean, result.seconds)

    def _record(self, result: VersionEval, tokens: int) -> None:
        """The record the panel ingests (before the whole result is stored: a version whose result is stored has its
        record), then what judging the run needs."""
        record = telemetry_record(result, self._step(result.version), tokens)
        self.stream.add(record)
        if not self.stream.flush():
            raise StoreError("the eval telemetry could not be written")
        print(json.dumps({"scores": record}), flush=True)  # for the trainer's Trackio and W&B reporting
        self.history.append((result.version, result.summary(TOTAL).avg))
        self.judge()

    def judge(self) -> None:
        """Once the held-out reward stops improving (`eval.patience` evaluations without beating the best by more
        than its interval), say so as an alert; with `eval.stop_on_regression`, ask the trainer to stop too (the best
        version is made current at the end, `make_best_current`)."""
        settings = self.spec.eval
        stuck = stalled(self.history, settings.patience)
        if stuck is None or self.alerted:
            return
        self.alerted = True
        best = dict(self.history)[stuck].mean
        said = (
            f"the held-out reward has not beaten v{stuck}'s {best:.3f} by more than its interval in "
            f"{settings.patience} evaluations"
        )
        if not settings.stop_on_regression:
            notice("error", f"{said}; training goes on (stop it, or set eval.stop_on_regression)", "held_out_stalled")
            return
        request = StopRequest(reason=f"{said} (eval.stop_on_regression)")
        self.store.put_bytes(layout.control_key(self.spec.run_id, STOP), request.model_dump_json().encode())
        self.stopped = True
        notice("error", f"{said}: the run stops, and its best version becomes current", "held_out_stalled")

    def make_best_current(self) -> None:
        """After a stop for a stalled held-out reward: the best adapter version (the base model is none) is current."""
        adapters = [(version, score) for version, score in self.history if version > 0]
        if not (self.stopped and adapters):
            return
        version = max(adapters, key=lambda item: (item[1].mean, -item[0]))[0]
        self.store.put_bytes(layout.current_key(self.spec.run_id), str(version).encode())
        notice("info", f"v{version}, the best on held-out prompts, is now the run's current version", "evaluation")

    def _stored_history(self) -> list[tuple[int, Interval]]:
        """The held-out rewards already stored under this evaluation's key (a restarted evaluator's), by version."""
        prefix = layout.eval_prefix(self.spec.run_id) + f"{self.key}/"
        stored = []
        for info in self.store.list(prefix):
            result = VersionEval.from_json(self.store.get_bytes(info.key))
            stored.append((result.version, result.summary(TOTAL).avg))
        return sorted(stored)

    @contextmanager
    def _served(self, version: int) -> Iterator[str]:
        """The name `version` is served under while it is scored: the base model's own, or the version loaded under
        its evaluation name on every replica for the block's duration (TRL unloads its policy name whenever it
        likes)."""
        if version == 0:
            yield self.spec.model.id
            return
        body = {"version": version}
        try:
            # The unload goes whatever happened: a load the proxy finished after this side gave up must not keep the
            # replicas' evaluation slot.
            try:
                response = requests.post(f"{self.proxy_url}/proxy/evaluation/load", json=body, timeout=LOAD_TIMEOUT_S)
            except requests.RequestException as error:
                raise SamplingError(
                    f"the proxy did not answer the load of v{version} ({type(error).__name__})"
                ) from None
            if response.status_code != 200:
                raise SamplingError(
                    f"the proxy could not load v{version}: {response.status_code} {response.text[:300]}"
                )
            yield response.text.strip()
        finally:
            try:
                requests.post(f"{self.proxy_url}/proxy/evaluation/unload", json=body, timeout=LOAD_TIMEOUT_S)
            except requests.RequestException as error:
                log.warning("unloading v%d after its evaluation failed: %s", version, error)

    def _step(self, version: int) -> int:
        """The optimizer step a version holds, from its manifest (0 for the base model)."""
        if version == 0:
            return 0
        meta = read_manifest(self.store, layout.adapter_prefix(self.spec.run_id, version)).meta
        return int(meta.get("step") or 0)

    def published(self) -> int:
        """The newest version loaded on the replicas (`adapters/CURRENT`), 0 before the first."""
        try:
            return int(self.store.get_bytes(layout.current_key(self.spec.run_id)).decode().strip() or 0)
        except (ObjectNotFound, ValueError):
            return 0

    def run(self, final_file: Path) -> None:
        """The base model first, then every due version as it is published, until the trainer names its last
        version in `final_file`: that one is evaluated too, then the evaluator ends. An iteration that fails is said
        and the loop goes on."""
        self._survive(lambda: self.evaluate(0))
        while True:
            final = _final_version(final_file)
            if final is not None:
                self._survive(functools.partial(self.evaluate, final))
                self._survive(self.make_best_current)
                return
            self._survive(self._next)
            time.sleep(POLL_S)

    def _next(self) -> None:
        version = self.due(self.published())
        if version is not None:
            self.evaluate(version)

    @staticmethod
    def _survive(step: Callable[[], None]) -> None:
        try:
            step()
        except StoreError as error:  # the bucket is the trainer's to worry about: try again next time
            log.warning("held-out evaluation: the store failed (%s); trying again", error)
        except Exception as error:
            log.exception("held-out evaluation failed")
            notice("warning", f"held-out evaluation failed: {type(error).__name__}: {error}")


def telemetry_record(result: VersionEval, step: int, tokens: int) -> EvalRecord:
    """What the panel ingests of a result (`VersionEval.record`), and the tokens generated for it (what evaluation
    costs beside the rollouts)."""
    return {**result.record(step), "tokens": tokens}


def notice(level: str, message: str, kind: str = "evaluation") -> None:
    """One line for the trainer to forward as an event (stdout is the evaluator's channel to it); an error is an
    alert on the panel until dismissed. Redacted: a reward's error or a replica's answer may quote anything."""
    print(json.dumps({"level": level, "message": redact(message), "kind": kind}), flush=True)


def _final_version(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def scoring(spec: RunSpec, held: HeldOut, model_path: str) -> tuple[EvalPrompts, Scorer]:
    """The held-out prompts as token ids, and the run's rewards and metrics as the trainer builds them (its EOS ids
    too): what an evaluator in a job scores with, beside the run or after it (jobs/evaluation/after_run.py)."""
    from transformers import AutoTokenizer

    from jobs.models import eos_token_ids
    from jobs.trainer.rewards import build_rewards

    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=spec.model.revision)
    eos = eos_token_ids(model_path, tokenizer.eos_token_id, spec.model.revision)
    scorer = Scorer(score_names(spec), list(build_rewards(scored_functions(spec), eos)))
    return eval_prompts(spec, held, tokenizer, eos), scorer


def prepare(spec: RunSpec, store: ObjectStore, proxy_url: str) -> RunEvaluator:
    """Everything an evaluation needs that does not change during the run: the held-out prompts as token ids, the
    rewards, the key results are stored under."""
    from jobs.models import resolve_model

    held = held_out(spec, store)
    prompts, scorer = scoring(spec, held, resolve_model(spec.model))
    return RunEvaluator(spec, store, proxy_url, prompts, scorer, result_key(spec, held, Sampling.of(spec)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.evaluation", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--proxy", required=True, help="the run's proxy, e.g. http://127.0.0.1:8000")
    parser.add_argument("--final-file", required=True, type=Path, help="where the trainer names its last version")
    args = parser.parse_args(argv)
    setup_logging("evaluator")
    ctx = open_run(args.spec, args.store_endpoint, args.store_region)
    evaluator = prepare(ctx.spec, ctx.store, args.proxy)
    count = len(evaluator.prompts.records)
    log.info("evaluating v0, every %d versions and the last on %d held-out prompts", evaluator.every, count)
    evaluator.run(args.final_file)
    return 0
