"""Checkpoints, resume, branches and the final adapter: everything of the trainer's state that lives in the store.

A job can be preempted at any moment and its disk is gone with it, so every checkpoint TRL writes is published to the
store (files first, manifest last; a store outage is ridden out for about a minute) and a restarted trainer resumes
from the newest complete one. Adapter versions keep counting after the highest version already in the store, so a
resumed trainer never republishes a name a replica already holds, and nothing an earlier attempt published is
overwritten.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.contract import ParentSpec, layout
from jobs.store import ObjectStore, download_published, list_published, publish_through_outage
from jobs.trainer import ranks
from jobs.trainer.callback import Callback

if TYPE_CHECKING:
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    from jobs.trainer.telemetry import TrainerTelemetry

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "checkpoint-{step}"  # TRL / transformers' own naming inside output_dir


def latest_checkpoint(store: ObjectStore, run_id: str) -> int | None:
    """The step of the newest published checkpoint of `run_id`, or None."""
    parsed = [layout.parse_checkpoint_dir(name) for name in list_published(store, layout.checkpoints_prefix(run_id))]
    steps = [step for step in parsed if step is not None]
    return max(steps) if steps else None


def download_checkpoint(store: ObjectStore, run_id: str, step: int, output_dir: str | Path) -> Path:
    target = Path(output_dir) / CHECKPOINT_DIR.format(step=step)
    download_published(store, layout.checkpoint_prefix(run_id, step), target)
    return target


def highest_version(store: ObjectStore, run_id: str) -> int:
    """The highest adapter version published for `run_id` (0 if none)."""
    versions = [layout.parse_version_dir(name) for name in list_published(store, layout.adapters_prefix(run_id))]
    return max((v for v in versions if v is not None), default=0)


class CheckpointComplete(Callback):
    """Holds every rank at each save until all of them wrote their part of the checkpoint.

    Under DDP the main process writes the model, optimizer and trainer state, and each rank its own RNG state
    (`rng_state_<rank>.pth`); transformers does not wait between writing and `on_save`, so without this the main
    process could upload a checkpoint another rank is still writing into. Runs on every rank, before the uploader.
    """

    def on_save(self, _args: Any, _state: Any, _control: Any, **_kwargs: Any) -> None:
        ranks.wait_for_all()


class CheckpointUploader(Callback):
    """Publishes each checkpoint TRL saves, before training moves on, so a preemption loses at most `save_steps`."""

    def __init__(self, store: ObjectStore, run_id: str, attempt: int, telemetry: TrainerTelemetry | None = None):
        self.store, self.run_id, self.attempt, self.telemetry = store, run_id, attempt, telemetry

    def on_save(self, args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        step = state.global_step
        folder = Path(args.output_dir) / CHECKPOINT_DIR.format(step=step)
        if not folder.is_dir():
            log.warning("checkpoint %s was not written; nothing to upload", folder)
            return
        if self.telemetry is not None:
            # Telemetry first: a relaunch resumes after this step, so nothing logged up to it may still sit in a
            # buffer when the checkpoint appears (a trainer killed then would lose those records for good).
            self.telemetry.flush()
        manifest = publish_through_outage(
            self.store, layout.checkpoint_prefix(self.run_id, step), folder, {"step": step, "attempt": self.attempt}
        )
        log.info("checkpoint of step %d published (%d bytes)", step, manifest.total_size)
        if self.telemetry is not None:
            self.telemetry.event("checkpoint", f"checkpoint of step {step} saved to the store", step=step)
            self.telemetry.events.flush()


class ContinueVersions(Callback):
    """Before TRL's first sync, move its version counter past every version already in the store.

    TRL restores `model_version` from the checkpoint, but an interrupted attempt may have published versions after
    that checkpoint; continuing from the store's highest keeps every published version and every replica name unique.
    Must run before TRL's own train-begin callback, i.e. be passed to the trainer's constructor.
    """

    def __init__(self, store: ObjectStore, run_id: str):
        self.store, self.run_id = store, run_id
        self.trainer: AsyncGRPOTrainer | None = None  # set once the trainer exists; needed only once training begins

    def on_train_begin(self, _args: Any, _state: Any, _control: Any, **_kwargs: Any) -> None:
        trainer = self.trainer
        highest = highest_version(self.store, self.run_id)
        if trainer is not None and highest > trainer.model_version:
            log.info("adapter versions continue after v%d (already in the store)", highest)
            trainer.model_version = highest
            if trainer.rollout_worker is not None:
                trainer.rollout_worker.update_model_version(highest)


def download_parent_adapter(store: ObjectStore, parent: ParentSpec, workdir: str | Path) -> Path:
    """Fetch the parent run's adapter version a branch starts from (once per job: by its main process)."""
    folder = Path(workdir) / f"parent-{parent.run_id}-v{parent.version}"
    download_published(store, layout.adapter_prefix(parent.run_id, parent.version), folder)
    return folder


def load_parent_adapter(folder: str | Path, parent: ParentSpec, model: Any) -> None:
    """Start a branch from a parent run's adapter version (downloaded to `folder`): copy its LoRA weights into
    `model` (a PeftModel). Every rank loads them, so every replica of the model starts from the same weights."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(folder) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(
            f"parent {parent.run_id} v{parent.version} does not fit this model's LoRA layout ({len(unexpected)} "
            "unexpected tensors); a branch must keep its parent's model and LoRA settings"
        )
    log.info("branch starts from %s v%d", parent.run_id, parent.version)


def publish_final(
    store: ObjectStore, run_id: str, trainer: AsyncGRPOTrainer, workdir: str | Path, meta: dict[str, Any]
) -> None:
    """Save the trained adapter (adapter files only) to `final/`.

    Every rank calls it: under FSDP each holds a part of every LoRA weight, and gathering them is a collective (TRL's
    own adapter save, as at each sync); the main process alone writes and uploads the files.
    """
    from trl.experimental.async_grpo.async_grpo_trainer import save_lora_adapter

    folder = Path(workdir) / "final-adapter"
    model = trainer.accelerator.unwrap_model(trainer.model)
    save_lora_adapter(model, trainer.accelerator, model.active_adapters[0], str(folder))
    if trainer.accelerator.is_main_process:
        publish_through_outage(store, layout.final_prefix(run_id), folder, meta)
