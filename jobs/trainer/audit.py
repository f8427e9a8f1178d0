"""The policy audit: proof that every replica serves exactly the policy the trainer just published.

Right after a sync the trainer's weights *are* the published version. The audit sends one fixed probe prompt with a
fixed seed to every replica under that version's name, then scores the tokens each replica sampled with the
trainer's own forward (base + adapter, the same fused log-prob head the loss uses) at the same temperature. The
largest per-token log-prob difference per replica is recorded in the store (`audit/vNNNNNN.json`); above the
tolerance the run gets an alert. A replica silently serving the base model or a stale adapter differs by far more
than numerical noise.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import requests
import torch
from transformers import TrainerCallback

from jobs.contract import derived, layout
from jobs.store import ObjectStore, StoreError
from jobs.trainer.dataset import prompt_token_ids

log = logging.getLogger(__name__)
PROBE_MESSAGES = [{"role": "user", "content": "Write a short sentence about the sea."}]
PROBE_TOKENS = 16
PROBE_SEED = 1234
# Per-token |log p_trainer - log p_replica| above this is a mismatch: fp32 on both sides agrees to ~1e-5; bf16/fp16
# kernels on different hardware differ by up to a few 1e-2.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def tolerance_for(dtype: str) -> float:
    return TOLERANCE.get(dtype, 0.1)


def trainer_log_probs(trainer, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
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
    return log_probs[start : start + len(completion_ids)].tolist()


class PolicyAudit:
    def __init__(
        self,
        trainer,
        tokenizer,
        store: ObjectStore,
        run_id: str,
        replicas_fn,
        token: str | None,
        temperature: float,
        tolerance: float,
        telemetry=None,
    ):
        self.trainer, self.store, self.run_id = trainer, store, run_id
        self.replicas_fn, self.token, self.temperature, self.tolerance = replicas_fn, token, temperature, tolerance
        self.telemetry = telemetry
        self.prompt_ids = prompt_token_ids(tokenizer, PROBE_MESSAGES)

    def run(self, version: int, step: int) -> dict[str, Any]:
        """Audit `version` on every replica; writes the result to the store and returns it."""
        results: dict[str, Any] = {}
        for replica in self.replicas_fn():
            try:
                tokens, served = self._probe(replica["url"], version)
                if not tokens:
                    raise ValueError("the replica returned no tokens")
                local = trainer_log_probs(self.trainer, self.prompt_ids, tokens)
                diffs = [abs(a - b) for a, b in zip(local, served, strict=True)]
                results[replica["role"]] = {
                    "max_abs_diff": max(diffs),
                    "mean_abs_diff": sum(diffs) / len(diffs),
                    "tokens": len(tokens),
                }
            except Exception as error:
                results[replica["role"]] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        ok = bool(results) and all(r.get("max_abs_diff", float("inf")) <= self.tolerance for r in results.values())
        record = {
            "version": version,
            "step": step,
            "time": time.time(),
            "tolerance": self.tolerance,
            "ok": ok,
            "replicas": results,
        }
        try:
            self.store.put_bytes(layout.audit_key(self.run_id, version), json.dumps(record).encode())
        except StoreError as error:
            log.warning("audit of v%d not stored: %s", version, error)
        if self.telemetry is not None:
            worst = max((r.get("max_abs_diff", float("inf")) for r in results.values()), default=float("inf"))
            level = "info" if ok else "error"
            message = (
                f"policy audit v{version}: replicas match the trainer (max |Δlogp| {worst:.2e})"
                if ok
                else f"policy audit v{version} FAILED: {json.dumps(results)[:400]}"
            )
            self.telemetry.event("audit", message, level=level, version=version, ok=ok)
        log.info("policy audit v%d: ok=%s %s", version, ok, results)
        return record

    def _probe(self, url: str, version: int) -> tuple[list[int], list[float]]:
        body = {
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


class AuditCallback(TrainerCallback):
    """Audits every k-th version right after TRL's sync. Add it *after* constructing the trainer so it runs after
    TRL's sync callback within the same step."""

    def __init__(self, audit: PolicyAudit, every: int):
        self.audit, self.every = audit, every
        self._last = 0

    def on_step_end(self, _args, state, _control, **_kwargs):
        version = int(self.audit.trainer.model_version)
        if self.every and version != self._last and version % self.every == 0:
            self._last = version
            self.audit.run(version, state.global_step)
