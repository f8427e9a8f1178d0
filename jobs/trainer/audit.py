"""The policy audit: proof that every replica serves exactly the policy the trainer just published.

Right after a sync the trainer's weights *are* the published version vN. The audit sends one fixed probe prompt with
a fixed seed to every replica under vN's name, then scores the tokens each replica sampled with the trainer's own
forward (the same fused log-prob head the loss uses) at the same temperature, three times: under vN, under v(N-1)
(its LoRA weights, kept from the previous sync, loaded for a moment) and under the base model (adapter disabled). The
mean per-token |Δlogp| to each is the replica's distance to that policy. A replica passes only when it is within the
tolerance of vN *and* much closer to vN than to v(N-1) and to the base: with an absolute tolerance alone, a bf16
replica a few 1e-2 off could be serving v(N-1) when one sync moved the policy less than the noise. When vN cannot be
told apart from an alternative on the probe (the first version equals the base: LoRA's B starts at zero; a tiny
learning rate), the record says so: `inconclusive`, not a failure.

A failing replica (`stale`: serves v(N-1); `base`: serves the base model; `mismatch`: neither) is ejected through the
proxy, which re-admits it after unloading everything it holds and loading every live version afresh. The same replica
failing `FAILURES_TO_STOP` audits in a row stops the run (with a checkpoint) and fails it with the reason: a replica
that keeps serving the wrong policy after clean re-loads is broken, and rollouts from it would train on garbage.

The result goes to the store (`audit/vNNNNNN.json`: per replica the three distances, the separations of vN from the
alternatives, the verdict and why) and to the events stream.

Under FSDP the trainer's forward gathers each layer's weights from every rank, so every rank runs the audit: the main
process probes the replicas and hands the sampled tokens to the others, every rank scores them (and swaps its part of
the LoRA weights in and out), and the main process judges, stores and acts. Under DDP and with one process the main
process audits alone, as each rank holds the whole model.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Required, TypedDict, TypeVar

import requests
import torch

from jobs.contract import derived, layout
from jobs.store import ObjectStore, StoreError, download_published
from jobs.trainer import ranks
from jobs.trainer.callback import Callback
from jobs.trainer.dataset import prompt_token_ids

if TYPE_CHECKING:
    from jobs.proxy.upstreams import ReplicaView
    from jobs.trainer.telemetry import Telemetry

T = TypeVar("T")
log = logging.getLogger(__name__)
PROBE_MESSAGES = [{"role": "user", "content": "Write a short sentence about the sea."}]
PROBE_TOKENS = 16
PROBE_SEED = 1234
# Mean per-token |log p_trainer - log p_replica| above this is a mismatch: fp32 on both sides agrees to ~1e-6 (measured
# on the demo); bf16/fp16 kernels on different hardware differ by up to a few 1e-2.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
# "Much closer": the replica's distance to vN times this must stay below its distance to v(N-1) and to the base. An
# alternative is told apart from vN only when the two are at least (MARGIN + 1) tolerances apart on the probe: then a
# replica within the tolerance of vN is always MARGIN times closer to it (triangle inequality), and one serving the
# alternative never is.
MARGIN = 4.0
FAILURES_TO_STOP = 3  # consecutive failed audits of one replica (each followed by a clean re-load) that stop the run
PASSING = ("match", "inconclusive")
FAILING = ("stale", "base", "mismatch")


class ReplicaVerdict(TypedDict, total=False):
    """One replica's entry in an audit record (`audit/vNNNNNN.json`'s `replicas`): its verdict and the figures
    behind it, or the error its probe met (verdict "error")."""

    verdict: Required[str]
    why: str
    error: str
    distance: dict[str, float]
    separation: dict[str, float]
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    ejected_at: float
    eject_error: str


class AuditRecord(TypedDict, total=False):
    """`audit/vNNNNNN.json`, the audit of one version on every replica, as `PolicyAudit.run` writes it and the panel
    reads it back (backend/ingestion/versions.py). No key is required: the panel takes each with a default, as a
    record may come from an older trainer, and ranks other than the main one return an empty record."""

    version: int
    step: int
    time: float
    tolerance: float
    margin: float
    ok: bool
    replicas: dict[str, ReplicaVerdict]  # by role


# One probe's tokens, and the trainer's log-probs of them under each policy ("current", "previous", "base").
Scores = dict[str, dict[tuple[int, ...], list[float]]]


def tolerance_for(dtype: str) -> float:
    return TOLERANCE.get(dtype, 0.1)


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def judge(
    version: int,
    distance: dict[str, float],
    separation: dict[str, float],
    tolerance: float,
) -> tuple[str, str]:
    """(verdict, why) for one replica.

    `distance` holds the replica's distance to "current" (vN) and to each alternative it could be serving by mistake
    ("previous": v(N-1), "base"), `separation` each alternative's distance from vN on the same tokens. The verdict is
    `match` (much closer to vN than to every alternative), `inconclusive` (close to vN, but some alternative cannot be
    told apart from vN on this probe), or a failure: `stale`, `base` (it is within the tolerance of that alternative)
    or `mismatch` (it serves none of them).
    """
    names = {"current": f"v{version}", "previous": f"v{version - 1}", "base": "the base model"}
    current = distance["current"]
    told_apart = {alt: separation[alt] >= (MARGIN + 1) * tolerance for alt in separation}
    closer = all(current * MARGIN <= distance[alt] for alt in separation if told_apart[alt])
    figures = ", ".join(f"{names[k]} {v:.2e}" for k, v in distance.items())
    if current > tolerance or not closer:
        nearest = min(distance, key=distance.__getitem__)
        if nearest != "current" and distance[nearest] <= tolerance:
            verdict = "stale" if nearest == "previous" else "base"
            return verdict, f"serves {names[nearest]} under v{version}'s name (mean |Δlogp| to {figures})"
        return "mismatch", f"serves none of v{version}, v{version - 1} or the base (mean |Δlogp| to {figures})"
    unclear = [alt for alt, apart in told_apart.items() if not apart]
    if unclear:
        what = " or ".join(f"{names[alt]} (separation {separation[alt]:.2e})" for alt in unclear)
        return "inconclusive", (
            f"within the tolerance of v{version}, but v{version} cannot be told from {what} on the probe "
            f"(needs {(MARGIN + 1) * tolerance:.1e})"
        )
    return "match", f"serves v{version} (mean |Δlogp| to {figures})"


def trainer_log_probs(trainer: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Log-probs of `completion_ids` after `prompt_ids` under the trainer's current weights, at its temperature."""
    model = trainer.model
    ids = list(prompt_ids) + list(completion_ids)
    length = len(ids)
    labels = [-100] * length
    for offset, token in enumerate(completion_ids):
        labels[len(prompt_ids) - 1 + offset] = token
    device = next(model.parameters()).device
    inputs = {
        "input_ids": torch.tensor([ids], device=device),
        "position_ids": torch.arange(length, device=device).unsqueeze(0),
        "shift_labels": torch.tensor([labels], device=device),
        # One packed segment covering the whole sequence: the trainer's tree attention on a plain causal sequence.
        "tree_kv_index": torch.arange(length, device=device),
        "tree_cu_seqlens_q": torch.tensor([0, length], dtype=torch.int32, device=device),
        "tree_cu_seqlens_k": torch.tensor([0, length], dtype=torch.int32, device=device),
        "tree_max_seqlen_q": length,
        "tree_max_seqlen_k": length,
    }
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(fused_lm_head=True, **inputs)
    finally:
        model.train(was_training)
    log_probs = outputs.log_probs.flatten().float().cpu()
    start = len(prompt_ids) - 1
    scores: list[float] = log_probs[start : start + len(completion_ids)].tolist()
    return scores


def lora_weights(model: Any) -> dict[str, torch.Tensor]:
    """A copy of a PeftModel's LoRA weights (not views: training moves on in place)."""
    from peft import get_peft_model_state_dict

    return {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}


def laid_out_like(own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` placed as the model holds its own (`own`, from `lora_weights`): where FSDP shards a weight, each
    rank keeps its part of the whole tensor read from the store (every rank has it, so nothing is sent)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    placed = {}
    for name, tensor in weights.items():
        mine = own.get(name)
        if isinstance(mine, DTensor) and not isinstance(tensor, DTensor):
            tensor = distribute_tensor(
                tensor.to(mine.device, mine.dtype), mine.device_mesh, mine.placements, src_data_rank=None
            )
        placed[name] = tensor
    return placed


def read_published_weights(store: ObjectStore, run_id: str, version: int) -> dict[str, torch.Tensor] | None:
    """A version's LoRA weights as it was published (checked against its manifest), or None if it cannot be read.

    The published file is PEFT's save of the same adapter, keyed as `lora_weights` keys it."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        try:
            download_published(store, layout.adapter_prefix(run_id, version), Path(folder) / "adapter")
            return load_file(Path(folder) / "adapter" / "adapter_model.safetensors")
        except (StoreError, OSError) as error:
            log.warning("v%d's weights could not be read back for the audit: %s", version, error)
            return None


class VersionWeights:
    """The LoRA weights of the trainer's last two versions, kept at each sync so the audit of vN can score v(N-1).

    The adapter is small (LoRA only), so two copies cost little. TRL keeps no earlier weights: after a resume the
    version before the first one is read back from the store, where it was published (`fetch`).
    """

    def __init__(self) -> None:
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def note(self, model: Any, version: int) -> None:
        """Keep `model`'s weights as `version` (which it must hold now) and the version before it; drop older ones."""
        if version not in self.kept:
            self.kept[version] = lora_weights(model)
        self.kept = {v: weights for v, weights in self.kept.items() if version - 1 <= v <= version}

    def has(self, version: int) -> bool:
        return version in self.kept

    def keep(self, version: int, weights: dict[str, torch.Tensor] | None) -> bool:
        """Keep `weights` (e.g. `read_published_weights`) as `version`'s; False when there are none."""
        if weights is not None:
            self.kept[version] = weights
        return weights is not None

    @contextmanager
    def loaded(self, model: Any, version: int) -> Iterator[None]:
        """`model` with `version`'s LoRA weights for the duration; its own weights restored after, bit for bit."""
        from peft import set_peft_model_state_dict

        own = lora_weights(model)
        with torch.no_grad():
            set_peft_model_state_dict(model, laid_out_like(own, self.kept[version]))
        try:
            yield
        finally:
            with torch.no_grad():
                set_peft_model_state_dict(model, own)


class PolicyAuditFailed(RuntimeError):
    """The run stops because a replica kept failing the policy audit (the message says which and why)."""


class PolicyAudit:
    """Audits one version on every replica; keeps the LoRA weights of the version before, ejects and counts failures.

    `eject(role, reason)` takes a replica out of the proxy's rotation; `on_fatal(reason)` is called once when a
    replica has failed `FAILURES_TO_STOP` audits in a row (the job stops the run through it). `collective`: every
    rank runs the audit, as FSDP needs (see the module's docstring); only the main process probes, judges and acts.
    """

    def __init__(
        self,
        trainer: Any,
        tokenizer: Any,
        store: ObjectStore,
        run_id: str,
        replicas_fn: Callable[[], list[ReplicaView]],
        token: str | None,
        temperature: float,
        tolerance: float,
        telemetry: Telemetry | None = None,
        eject: Callable[[str, str], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        collective: bool = False,
    ):
        self.trainer, self.store, self.run_id = trainer, store, run_id
        self.replicas_fn, self.token, self.temperature, self.tolerance = replicas_fn, token, temperature, tolerance
        self.telemetry, self.eject, self.on_fatal = telemetry, eject, on_fatal
        self.prompt_ids = prompt_token_ids(tokenizer, PROBE_MESSAGES)
        self.versions = VersionWeights()
        self.failures: dict[str, int] = {}  # consecutive failed audits per replica role
        self.fatal: str | None = None
        self.collective = collective

    def shared(self, decide: Callable[[], T]) -> T:
        """What `decide()` returns on the main process: handed to every rank when the audit is collective."""
        return ranks.from_main(decide) if self.collective else decide()

    def _peft_model(self) -> Any:
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def note_version(self, version: int) -> None:
        """Call right after a sync (the trainer holds `version`), so the audit of the next version can score v(N-1)."""
        self.versions.note(self._peft_model(), version)

    # -- the audit -------------------------------------------------------------------------------------------------

    def run(self, version: int, step: int) -> AuditRecord:
        """Audit `version` (which the trainer must hold now) on every replica; store, report and act on the result."""
        self.note_version(version)
        results, probes = self._probe_all(version) if ranks.is_main_process() else ({}, {})
        sequences = self.shared(lambda: sorted({tuple(tokens) for tokens, _ in probes.values()}))
        if sequences:
            results.update(self._judge_all(version, probes, self._score_all(version, sequences)))
        if not ranks.is_main_process():
            return {}
        ok = bool(results) and all(r["verdict"] in PASSING for r in results.values())
        for role, result in results.items():
            self._act(role, version, result)
        record: AuditRecord = {
            "version": version,
            "step": step,
            "time": time.time(),
            "tolerance": self.tolerance,
            "margin": MARGIN,
            "ok": ok,
            "replicas": results,
        }
        try:
            self.store.put_bytes(layout.audit_key(self.run_id, version), json.dumps(record).encode())
        except StoreError as error:
            log.warning("audit of v%d not stored: %s", version, error)
        if self.telemetry is not None:
            worst = max((r.get("max_abs_diff", float("inf")) for r in results.values()), default=float("inf"))
            verdicts = ", ".join(f"{role} {r['verdict']}" for role, r in sorted(results.items()))
            message = (
                f"policy audit v{version}: replicas serve v{version} ({verdicts}; max |Δlogp| {worst:.2e})"
                if ok
                else f"policy audit v{version} FAILED: {json.dumps(results)[:400]}"
            )
            self.telemetry.event("audit", message, level="info" if ok else "error", version=version, ok=ok)
        log.info("policy audit v%d: ok=%s %s", version, ok, results)
        return record

    def _probe_all(self, version: int) -> tuple[dict[str, ReplicaVerdict], dict[str, tuple[list[int], list[float]]]]:
        """(errors, probes): each replica's sampled tokens and their log-probs under `version`'s name, or its error."""
        errors: dict[str, ReplicaVerdict] = {}
        probes: dict[str, tuple[list[int], list[float]]] = {}
        for replica in self.replicas_fn():
            try:
                tokens, served = self._probe(replica["url"], version)
                if not tokens:
                    raise ValueError("the replica returned no tokens")
                probes[replica["role"]] = (tokens, served)
            except Exception as error:
                errors[replica["role"]] = {"verdict": "error", "error": f"{type(error).__name__}: {str(error)[:300]}"}
        return errors, probes

    def _score_all(self, version: int, sequences: list[tuple[int, ...]]) -> Scores:
        """The trainer's log-probs of each sequence under vN, v(N-1) (when its weights can be had) and the base."""

        def score() -> dict[tuple[int, ...], list[float]]:
            return {seq: trainer_log_probs(self.trainer, self.prompt_ids, list(seq)) for seq in sequences}

        scores = {"current": score()}
        if version > 1 and not self.versions.has(version - 1):  # the first audit after a resume
            self.versions.keep(
                version - 1, self.shared(lambda: read_published_weights(self.store, self.run_id, version - 1))
            )
        if self.versions.has(version - 1):
            with self.versions.loaded(self._peft_model(), version - 1):
                scores["previous"] = score()
        with self._peft_model().disable_adapter():
            scores["base"] = score()
        return scores

    def _judge_all(
        self, version: int, probes: dict[str, tuple[list[int], list[float]]], scores: Scores
    ) -> dict[str, ReplicaVerdict]:
        """One verdict per probed replica, from the trainer's scores of its tokens (`_score_all`)."""
        results: dict[str, ReplicaVerdict] = {}
        for role, (tokens, served) in probes.items():
            seq = tuple(tokens)
            distance = {name: mean_abs_diff(by_seq[seq], served) for name, by_seq in scores.items()}
            separation = {name: mean_abs_diff(by_seq[seq], scores["current"][seq]) for name, by_seq in scores.items()}
            del separation["current"]
            verdict, why = judge(version, distance, separation, self.tolerance)
            results[role] = {
                "verdict": verdict,
                "why": why,
                "distance": distance,
                "separation": separation,
                "max_abs_diff": max(abs(a - b) for a, b in zip(scores["current"][seq], served, strict=True)),
                "mean_abs_diff": distance["current"],
                "tokens": len(tokens),
            }
        return results

    def _act(self, role: str, version: int, result: ReplicaVerdict) -> None:
        """Eject a failing replica and count its failures in a row; a pass resets the count (errors change nothing:
        a probe that timed out proves nothing about the policy)."""
        verdict = result["verdict"]
        if verdict in PASSING:
            self.failures[role] = 0
        if verdict not in FAILING:
            return
        self.failures[role] = self.failures.get(role, 0) + 1
        reason = f"failed the policy audit of v{version}: {result['why']}"
        if self.eject is not None:
            try:
                self.eject(role, reason)
                result["ejected_at"] = time.time()
            except Exception as error:  # the audit's record and the stop below still stand
                result["eject_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                log.warning("could not eject %s after its failed audit: %s", role, error)
        if self.telemetry is not None:
            self.telemetry.event(
                "replica_ejected",
                f"{role} {reason}; ejected, it is re-admitted after a clean re-load",
                level="error",
                role=role,
                version=version,
                verdict=verdict,
            )
        if self.failures[role] >= FAILURES_TO_STOP and self.fatal is None:
            self.fatal = (
                f"{role} failed the policy audit {self.failures[role]} times in a row, clean re-loads between "
                f"(last, v{version}: {result['why']}); it does not serve the policy the trainer publishes. The run "
                "stopped with a checkpoint: check that replica's engine, then relaunch the trainer to resume"
            )
            log.error(self.fatal)
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)

    def _probe(self, url: str, version: int) -> tuple[list[int], list[float]]:
        body: dict[str, str | int | float | bool | list[int]] = {
            "model": derived.replica_adapter_name(self.run_id, version),
            "prompt": self.prompt_ids,
            "max_tokens": PROBE_TOKENS,
            "temperature": self.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "n": 1,
            "seed": PROBE_SEED,
            "logprobs": 0,
            "return_token_ids": True,
        }
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        response = requests.post(url.rstrip("/") + "/v1/completions", json=body, headers=headers, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


class AuditCallback(Callback):
    """Audits every k-th version right after TRL's sync, and right after a resume (unless periodic audits are off:
    `every` 0); keeps each version's weights.

    Add it *after* constructing the trainer so it runs after TRL's callbacks (its cold sync at train begin, its sync
    at step end). A version is audited only at the moment it was synced: with `weight_sync_steps` > 1 the trainer's
    weights move on at the next optimizer step while its version stays, and an audit then would blame the replicas.
    """

    def __init__(self, audit: PolicyAudit, every: int):
        self.audit, self.every = audit, every
        self._version_at_begin = -1

    def _version(self) -> int:
        return self.audit.shared(lambda: int(self.audit.trainer.model_version))  # TRL counts on the main process

    def on_train_begin(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        version = self._version()  # TRL's cold sync just published the weights the trainer starts (or resumes) from
        self.audit.note_version(version)
        if self.every and (state.global_step > 0 or version % self.every == 0):
            self.audit.run(version, state.global_step)

    def on_step_begin(self, _args: Any, _state: Any, _control: Any, **_kwargs: Any) -> None:
        self._version_at_begin = self._version()

    def on_step_end(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        version = self._version()
        if version == self._version_at_begin:
            return  # no sync in this step: the trainer no longer holds its version's weights
        self.audit.note_version(version)
        if self.every and version % self.every == 0:
            self.audit.run(version, state.global_step)
