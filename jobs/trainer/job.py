"""The trainer job: TRL's AsyncGRPOTrainer with LoRA, pointed at our proxy, writing everything to the store.

    python -m jobs.trainer --spec <storage uri>/runs/<run_id>/spec.json

Order of events: start the proxy and wait for replicas; build dataset, rewards and trainer; resume from the newest
stored checkpoint (or start a branch from its parent's adapter); train; publish and audit the final version; and, on
every way out (success, error, SIGTERM), stop the proxy and the replicas and say why in `status/trainer.json`.

Under `accelerate launch` (several data-parallel processes, see jobs/trainer/ranks.py) every rank builds the same
trainer and trains, but only the main process does what reaches outside the training loop: the proxy and the replica
watchdog, telemetry and status, checkpoint uploads, audits, step hints, the final publish and stopping the replicas.
What the ranks must agree on — the working folder, the checkpoint to resume from, how to hold the model (DDP or
FSDP), when to stop — the main process decides and shares. Under FSDP every rank also takes part in what gathers
the sharded weights: each audit's scoring and the final adapter's save.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from jobs import pins, settings
from jobs.chat_templates import fit_tokenizer
from jobs.contract import RunSpec, derived, layout
from jobs.environments.loading import check_environment_column, row_tools, trainer_arguments
from jobs.evaluation.heldout import training_rows
from jobs.models import eos_token_ids, parameter_count, resolve_model
from jobs.ports import free_port
from jobs.runtime import RunContext, add_run_arguments, open_run, read_json, setup_logging, spec_uri
from jobs.store import ObjectStore, StoreError
from jobs.trainer import cpu_compat, ranks
from jobs.trainer.audit import AuditCallback, PolicyAudit, PolicyAuditFailed, tolerance_for
from jobs.trainer.checkpoints import (
    CheckpointComplete,
    CheckpointUploader,
    ContinueVersions,
    download_checkpoint,
    download_parent_adapter,
    latest_checkpoint,
    load_parent_adapter,
    publish_final,
)
from jobs.trainer.config import grpo_config, lora_config
from jobs.trainer.control import GracefulStop, StepHint
from jobs.trainer.dataset import build_prompts, load_rows
from jobs.trainer.evaluator_process import EvaluatorProcess, evaluator_command
from jobs.trainer.held_out_reports import HeldOutReports
from jobs.trainer.proxy_process import (
    ProxyProcess,
    StoreUnreachable,
    TrainingInterrupted,
    Watchdog,
    replica_watchdog,
)
from jobs.trainer.replicas import read_replica_jobs, stop_replicas
from jobs.trainer.reporting import install_reporting_packages, report_environment
from jobs.trainer.rewards import build_rewards
from jobs.trainer.rollout_worker import use_job_rollout_worker
from jobs.trainer.stale_drops import summarise_stale_drops
from jobs.trainer.telemetry import (
    RecordingQueue,
    RewardErrorForwarder,
    SilentTelemetry,
    Telemetry,
    TelemetryCallback,
    TrainerTelemetry,
)

if TYPE_CHECKING:
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, RewardFunc

log = logging.getLogger("jobs.trainer")
# A failed write with less free space than this (or 5% of the disk) left is reported as a full disk.
LOW_DISK_BYTES = 64 * 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.trainer", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument(
        "--output-dir",
        default=settings.TRAINER_WORKDIR.get(),
        help=settings.TRAINER_WORKDIR.flag_help("local working folder, the same for every rank"),
    )
    parser.add_argument(
        "--proxy-port",
        type=int,
        default=None,
        help="the proxy's port on 127.0.0.1 (default: a free one; trainers sharing a host, as on the Hub Jobs "
        "emulator, would otherwise meet on one port and talk to each other's proxy)",
    )
    parser.add_argument("--replica-wait", type=float, default=900.0, help="seconds to wait for healthy replicas")
    parser.add_argument(
        "--replica-loss-timeout",
        type=float,
        default=settings.REPLICA_LOSS_TIMEOUT.number(),
        help=settings.REPLICA_LOSS_TIMEOUT.flag_help("seconds with no healthy replica before the run fails"),
    )
    parser.add_argument(
        "--store-outage-timeout",
        type=float,
        default=settings.STORE_OUTAGE_TIMEOUT.number(),
        help=settings.STORE_OUTAGE_TIMEOUT.flag_help("seconds the bucket may fail every call before the run stops"),
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=int(settings.TORCH_THREADS.number() or 0) or None,
        help=settings.TORCH_THREADS.flag_help("CPU threads for torch"),
    )
    return parser.parse_args(argv)


def previous_attempt(ctx: RunContext) -> int:
    try:
        return int(read_json(ctx.store, layout.status_key(ctx.spec.run_id, "trainer")).get("attempt", 0))
    except (StoreError, ValueError, TypeError):
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    main_process = ranks.is_main_process()
    setup_logging("trainer" if main_process else f"trainer-rank{ranks.rank()}")
    summarise_stale_drops()
    cuda = torch.cuda.is_available()
    if args.torch_threads or not cuda:
        torch.set_num_threads(args.torch_threads or 1)  # on CPU the replicas need the other cores
    ranks.join_process_group(cuda)
    ctx = open_run(args.spec, args.store_endpoint, args.store_region)
    spec, store = ctx.spec, ctx.store
    recorder: TrainerTelemetry | None = None  # the main process's telemetry, which records
    if main_process:
        attempt = previous_attempt(ctx) + 1
        recorder = TrainerTelemetry(store, spec.run_id, attempt, spec.grpo.max_steps)
        telemetry: Telemetry = recorder
    else:
        attempt, telemetry = 0, SilentTelemetry()  # the main process reports for every rank
    telemetry.status("starting")
    proxy_port = args.proxy_port or free_port()  # only the main process's proxy runs and is asked
    proxy = ProxyProcess(spec_uri(spec.storage, spec.run_id), proxy_port, args.store_endpoint, args.store_region)
    watchdogs: list[Watchdog] = []
    replica_jobs = None  # the replica jobs as recorded at start: stoppable even if the bucket is gone by the end
    stop = GracefulStop(store, spec.run_id, telemetry)
    stop.install_signal_handler()
    outcome, exit_code = "failed", 1
    workdir: Path | None = None
    errors = None
    evaluator: EvaluatorProcess | None = None
    reports: HeldOutReports | None = None
    try:
        pins.require("trl")  # TRL's experimental async trainer changes between releases: our code fits 1.16.0 only
        workdir = Path(ranks.shared_workdir(args.output_dir, spec.run_id))
        if not cuda:
            cpu_compat.apply_cpu_patches()
        # Before the evaluator starts: it loads the environment's code too.
        ranks.from_main(lambda: pins.install_missing(spec.environment.packages, "for the environment's code"))
        if main_process:
            watchdogs.append(start_proxy(proxy, args, telemetry))
            watchdogs.append(store_watchdog(store, spec.run_id, args.store_outage_timeout).start())
            replica_jobs = read_replica_jobs(store, spec.run_id)
            reports = HeldOutReports() if spec.reporting.report_to() else None
            evaluator = start_evaluator(spec, args, proxy, workdir, telemetry, reports)

        ranks.from_main(lambda: install_reporting_packages(spec))
        os.environ.update(report_environment(spec))
        from transformers import AutoTokenizer
        from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

        use_job_rollout_worker(derived.rollout_limits(spec).scored_groups, spec.environment.max_episode_tokens)

        model_path = resolve_model(spec.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=spec.model.revision, padding_side="left")
        # e.g. Qwen2.5-Math: TRL reads its replies with the recipe's template
        fit_tokenizer(tokenizer, spec.model.id, tools=spec.environment.enabled)
        max_prompt = spec.model.max_model_len - spec.grpo.max_completion_length
        # Rows carved off for held-out evaluation are never trained on (jobs/evaluation/heldout.py).
        rows = training_rows(load_rows(spec.dataset, store), spec.eval)
        environment = trainer_arguments(spec.environment, workdir / "environment")
        check_environment_column(environment, rows)
        tools_for = row_tools(environment) if spec.environment.enabled else None
        dataset = build_prompts(spec.dataset, rows, tokenizer, max_prompt, tools_for)
        if spec.eval.holdout is not None:
            log.info("%d rows held out for evaluation; training on the other %d", spec.eval.holdout, len(rows))
        error_log = workdir / "reward_errors.jsonl"
        if main_process:
            errors = RewardErrorForwarder(error_log, telemetry).start()
        eos = eos_token_ids(model_path, tokenizer.eos_token_id, spec.model.revision)
        rewards = build_rewards(spec.rewards, eos, error_log)

        sharding = ranks.from_main(lambda: choose_sharding(spec, model_path, cuda))
        resume_step, resume_path = ranks.from_main(lambda: fetch_resume_checkpoint(store, spec.run_id, workdir))
        if resume_step is not None:
            telemetry.event(
                "resume",
                f"attempt {attempt} resumes from the checkpoint of step {resume_step}",
                resumed_from_step=resume_step,
            )
        continue_versions = ContinueVersions(store, spec.run_id)
        callbacks = [CheckpointComplete(), stop]
        if recorder is not None:  # the main process
            callbacks += [
                TelemetryCallback(recorder),
                CheckpointUploader(store, spec.run_id, attempt, recorder),
                continue_versions,
                StepHint(proxy.post_step),
            ]
        trainer = AsyncGRPOTrainer(
            model=model_path,
            # TRL awaits an async reward and leaves a None score out; its `RewardFunc` type says neither.
            reward_funcs=cast("list[RewardFunc]", rewards),
            args=grpo_config(spec, str(workdir / "output"), proxy.url, cuda, sharding),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            peft_config=lora_config(spec),
            **environment,
        )
        continue_versions.trainer = trainer
        if reports is not None and evaluator is not None:
            reports.attach(trainer)
        parent_spec = spec.parent
        if parent_spec is not None and resume_path is None:
            parent = ranks.from_main(lambda: download_parent_adapter(store, parent_spec, workdir))
            load_parent_adapter(parent, parent_spec, trainer.model)
        audit = watch_trainer(trainer, tokenizer, ctx, proxy, telemetry, recorder, cuda, stop, sharding)

        telemetry.status("training", resumed_from_step=resume_step, sharding=sharding)
        trainer.train(resume_from_checkpoint=resume_path)

        telemetry.status("saving")
        if trainer.state.global_step % spec.grpo.weight_sync_steps:
            # Publish the final weights as a version, so replicas and audit see them. Every rank: saving the adapter
            # is a collective.
            trainer._sync_weight()  # type: ignore[no-untyped-call]  # TRL's private method is not annotated
        # Decided on the main process, which always has an audit (`watch_trainer`).
        fatal, version = ranks.from_main(lambda: (cast(PolicyAudit, audit).fatal, int(trainer.model_version)))
        if fatal:
            raise PolicyAuditFailed(fatal)
        if audit is not None:  # the main process; every rank under FSDP
            audit.run(version, trainer.state.global_step)
        step = trainer.state.global_step
        publish_final(store, spec.run_id, trainer, workdir, {"step": step, "version": version, "attempt": attempt})
        if evaluator is not None and not stop.cancelled:  # a cancelled job ends now: no last evaluation
            telemetry.status("evaluating")
            evaluator.finish(version, cancelled=lambda: stop.cancelled)
            if reports is not None:
                reports.flush(trainer)
        outcome, exit_code = ("stopped", 0) if stop.reason else ("finished", 0)
        telemetry.event(
            outcome,
            f"training {outcome} at step {trainer.state.global_step}" + (f" ({stop.reason})" if stop.reason else ""),
        )
    except (TrainingInterrupted, PolicyAuditFailed) as error:
        telemetry.fail(str(error))
    except Exception as error:
        log.exception("training failed")
        telemetry.fail(describe_failure(error, workdir))
    finally:
        for watchdog in watchdogs:
            watchdog.stop()
        if evaluator is not None:
            evaluator.stop()
        if errors is not None:
            errors.close()
        if main_process:
            proxy.stop()
            stopped = stop_replicas(store, spec.run_id, f"the trainer {outcome}", replica_jobs)
            telemetry.status(outcome, replicas_stopped=stopped)
        telemetry.close()
        ranks.leave_process_group()
    return exit_code


def start_proxy(proxy: ProxyProcess, args: argparse.Namespace, telemetry: Telemetry) -> Watchdog:
    """Start the proxy, wait until replicas answer through it, and watch that they keep answering (main process)."""
    proxy.start()
    telemetry.status("waiting_replicas")
    proxy.wait_healthy(args.replica_wait, on_wait=lambda waited: telemetry.status(force=False, waited_s=waited))
    return replica_watchdog(proxy, args.replica_loss_timeout).start()


def start_evaluator(
    spec: RunSpec,
    args: argparse.Namespace,
    proxy: ProxyProcess,
    workdir: Path,
    telemetry: Telemetry,
    reports: HeldOutReports | None,
) -> EvaluatorProcess | None:
    """The held-out evaluator beside the proxy, when the run evaluates during training (main process); its scores go
    to `reports` too, when the run reports to Trackio or W&B."""
    if not (spec.eval.enabled and spec.eval.during_run):
        return None
    final_file = workdir / "evaluate-last-version"
    uri = spec_uri(spec.storage, spec.run_id)
    command = evaluator_command(uri, proxy.url, final_file, args.store_endpoint, args.store_region)
    on_scores = reports.add if reports is not None else None
    return EvaluatorProcess(command, final_file, telemetry, on_scores=on_scores).start()


def store_watchdog(store: ObjectStore, run_id: str, timeout: float) -> Watchdog:
    """Stops the run once its bucket has failed every call for `timeout` seconds: beyond the minute of outage the
    store calls ride through, nothing can be published or checkpointed, and the replicas would bill for nothing."""
    reason = (
        f"the run's bucket ({store.describe()}) has not answered for {timeout:.0f}s, so nothing can be published or "
        "checkpointed; the trainer stopped its replicas. Check the bucket and its credentials, then relaunch the "
        "trainer: it resumes from the newest checkpoint"
    )
    return Watchdog(lambda: store.exists(layout.spec_key(run_id)), timeout, StoreUnreachable(reason))


def choose_sharding(spec: RunSpec, model_path: str, cuda: bool) -> str:
    """How this job's ranks hold the model (`derived.trainer_sharding`), from the model's size and this machine's
    GPU memory (the main process decides: every rank must agree)."""
    gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else 0.0
    counts = spec.compute.trainer_sharding == "auto" and cuda and ranks.world_size() > 1  # else the size is moot
    parameters = parameter_count(model_path, spec.model.revision) if counts else None
    sharding = derived.trainer_sharding(spec.compute.trainer_sharding, ranks.world_size(), parameters, gpu_memory_gb)
    log.info("%d trainer process(es), sharding %s (model %s parameters)", ranks.world_size(), sharding, parameters)
    return sharding


def watch_trainer(
    trainer: AsyncGRPOTrainer,
    tokenizer: Any,
    ctx: RunContext,
    proxy: ProxyProcess,
    telemetry: Telemetry,
    recorder: TrainerTelemetry | None,
    cuda: bool,
    stop: GracefulStop,
    sharding: str,
) -> PolicyAudit | None:
    """What the job adds to TRL's trainer: on the main process (the one with a `recorder`) sample recording; policy
    audits (a replica failing one is ejected through the proxy; one failing them again and again stops the run) on
    the main process, and on every rank under FSDP, whose forward needs them all."""
    spec = ctx.spec
    collective = sharding == "fsdp"
    if recorder is not None:  # the main process
        # A stand-in for TRL's queue, with the methods the trainer calls (telemetry.RecordingQueue).
        trainer.rollout_queue = RecordingQueue(  # type: ignore[assignment]  # TRL types it as a Queue
            trainer.rollout_queue, recorder, trainer, spec.grpo.max_staleness, episodes=spec.environment.enabled
        )
    elif not collective:
        return None
    audit = PolicyAudit(
        trainer,
        tokenizer,
        ctx.store,
        spec.run_id,
        proxy.replicas,
        settings.UPSTREAM_TOKEN.get(),
        spec.grpo.temperature,
        tolerance_for(audit_dtype(spec, cuda)),
        telemetry,
        eject=proxy.eject,
        on_fatal=stop.request,
        collective=collective,
    )
    trainer.add_callback(AuditCallback(audit, spec.grpo.audit_every))  # after TRL's sync callback: see AuditCallback
    return audit


def fetch_resume_checkpoint(store: ObjectStore, run_id: str, workdir: Path) -> tuple[int | None, str | None]:
    """(step, local folder) of the newest stored checkpoint, downloaded into `workdir`; (None, None) without one."""
    step = latest_checkpoint(store, run_id)
    if step is None:
        return None, None
    return step, str(download_checkpoint(store, run_id, step, workdir))


def audit_dtype(spec: RunSpec, cuda: bool) -> str:
    """The coarser precision of the audit's two sides: the trainer's forward (bf16 autocast on GPU) and the replica's
    serving dtype."""
    _, autocast = derived.trainer_precision(cuda)
    return "bfloat16" if autocast else spec.model.dtype


def describe_failure(error: BaseException, workdir: Path | None = None) -> str:
    """The error to show the user: TRL wraps the rollout worker's real failure in "see chained exception".

    A full working disk is named as such: torch's and safetensors' write errors do not say so (torch reports
    "unexpected pos ... iostream error").
    """
    errors: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and len(errors) < 4:
        errors.append(cause)
        cause = cause.__cause__ or cause.__context__
    messages = []
    for each in errors:
        first_line = str(each).strip().splitlines()[0] if str(each).strip() else type(each).__name__
        if "see chained exception" not in first_line:
            messages.append(first_line if ":" in first_line[:40] else f"{type(each).__name__}: {first_line}")
    text = " <- ".join(messages) or "training failed"
    full = disk_full(errors, workdir)
    return (f"{full}; {text}" if full else text)[:2000]


def disk_full(errors: list[BaseException], workdir: Path | None) -> str | None:
    """Why a failure is the working disk filling up (ENOSPC, or almost no space left on it), or None."""
    if workdir is None:
        return None
    try:
        usage = shutil.disk_usage(workdir)
    except OSError:
        return None
    no_space = any(isinstance(error, OSError) and error.errno == errno.ENOSPC for error in errors)
    if not no_space and usage.free >= min(LOW_DISK_BYTES, usage.total // 20):
        return None
    return (
        f"the trainer's disk is full: {workdir} has {usage.free // 1024} KiB free of {usage.total // 1024} KiB "
        "(checkpoints and adapter versions are written there before they go to the store); free space or give the "
        "trainer a larger disk (GRPO_TRAINER_WORKDIR, --output-dir)"
    )
