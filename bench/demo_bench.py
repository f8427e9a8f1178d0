"""Figures of the embedded demo per seed: the first reward and the end after Launch, steps/min, reward first 5 vs last
5 steps, the share of generated samples trained on, CPU time, adapter sync p50.

    .venv/bin/python bench/demo_bench.py --seeds 0 1 2 --steps 30 40
    .venv/bin/python bench/demo_bench.py --seeds 0 1 --steps 40 --trainer-processes 1 2   # DDP vs one process
    .venv/bin/python bench/demo_bench.py --seeds 0 1 --steps 40 --trainer-processes 1 2 --sharding ddp fsdp
    .venv/bin/python bench/demo_bench.py --seeds 0 1 2 --steps 40 --limits auto 64/256   # in flight / queued
    .venv/bin/python bench/demo_bench.py --seeds 0 1 2 --steps 40 --eval off demo auto   # held-out evaluation's cost
    .venv/bin/python bench/demo_bench.py --seeds 0 1 --steps 40 --engine cpu vllm   # our engine vs vLLM's CPU build

With several `--limits` each seed runs once per pair of rollout limits (`auto`: derived from the staleness window,
jobs/contract/derived.py's `rollout_limits`), side by side. "trained on" is the share of the samples the trainer
pulled that it trained on rather than dropped as too stale; "CPU" the CPU-seconds of every job process of the run.

With several `--eval` each seed runs once per setting, one after the other (paired rounds): `off`, `demo` (the
preset's, every tenth version) or `auto` (the interval derived to keep it within a tenth of the rollout tokens).
"eval tokens" are the tokens generated for held-out evaluation over those generated for rollouts.

With several `--engine` each seed runs once per engine, one after the other: `cpu` (ours) or `vllm` (vLLM's CPU
build, `scripts/setup vllm`). "replica start" is the slowest replica's time from its sidecar listening to its engine
answering /health (from the replica jobs' logs); "replicas' memory" the most the replica jobs' processes held
together, sampled once a second; "tokens/s" the tokens the replicas generated (their heartbeats' counters: rollouts,
dropped ones and held-out evaluation included) over the run's time from Launch less the replica start (Launch starts
the replicas within a second or two).

With several `--trainer-processes` each seed runs once per count, one after the other, so the rows compare the same
seed under the same load: the 2-process rows are the trainer under `accelerate launch` (2 ranks over gloo), each
rank taking half of every step's completions, each holding the model whole (DDP) or, with `--sharding fsdp`, half of
every weight (FSDP2); with several shardings each multi-process count runs once per sharding.

Each run is the real thing `python -m backend demo` does (trainer + proxy + 2 CPU replicas as processes, a local folder
as the bucket), in a fresh data folder. The load average is printed with each run: on a shared 2-core machine it
explains most of the spread in wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import TERMINAL_STATUSES
from backend.ingestion.poller import Poller
from backend.services.queries import QueryService
from backend.services.runs import RunService
from jobs.contract import RunSpec, layout
from jobs.demo.preset import demo_spec
from jobs.processes import job_processes
from jobs.store import LocalStore
from jobs.telemetry import read_stream


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _wait_for_children_to_exit(limit_s: float = 120.0) -> None:
    """Until every job process of the run has ended and been reaped, so its CPU time is counted."""
    deadline = time.monotonic() + limit_s
    me = str(os.getpid())
    while time.monotonic() < deadline:
        children = [p for p in Path("/proc").glob("[0-9]*/stat") if _parent(p) == me]
        if not children:
            return
        time.sleep(0.5)


def _replica_rss(jobs: Path) -> int:
    """Bytes resident in every process of the run's replica jobs now (engines in a session of their own included)."""
    pids: set[int] = set()
    for pgid in jobs.glob("replica-*/pgid"):
        pids |= set(job_processes(int(pgid.read_text())))
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * resource.getpagesize()
        except (OSError, IndexError, ValueError):
            pass  # ended meanwhile
    return total


def _parent(stat: Path) -> str | None:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


# Held-out evaluation during the run (issue 29): off, the demo preset's (every tenth version), or the derived interval.
EVALUATION: dict[str, dict[str, Any] | None] = {
    "off": {"split": "test", "during_run": False},
    "demo": None,
    "auto": {"split": "test"},
}


@dataclass
class FinishedRun:
    """A benched run that has ended, with its panel's database and its bucket still there to be read."""

    ctx: PanelContext
    root: Path  # the data folder; the bucket is its `store`
    spec: RunSpec
    wall_s: float  # from Launch to the poll that saw the run end
    first_reward_s: float | None  # from Launch to the first poll that saw a reward
    cpu_s: float  # CPU-seconds of every job process of the run
    replica_rss_gb: float  # the largest memory the replica jobs held together (every process of theirs), sampled


@contextmanager
def finished_run(run_id: str, make_spec: Callable[[str, str], RunSpec]) -> Iterator[FinishedRun]:
    """Create and launch `make_spec(run_id, storage_uri)` in a fresh data folder, as the panel does, and poll it to its
    end; the folder and its database last until the `with` ends. The benches that time a whole run (this one and
    bench/agent_bench.py) share this, so their wall times mean the same thing; bench/eval_bench.py, which times
    evaluations after its run and writes the run's dataset to the bucket before creating it, follows its own."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        ctx = PanelContext(Database(root / "panel.sqlite3"), root)
        try:
            service = RunService(ctx, "bench")
            spec = make_spec(run_id, f"file://{root / 'store'}")
            service.create(spec)
            started, cpu_before = time.monotonic(), _children_cpu_s()
            service.launch(run_id, wait=True)
            poller, first_reward, replica_rss = Poller(ctx), None, 0
            while True:
                replica_rss = max(replica_rss, _replica_rss(root / "jobs" / run_id))
                poller.poll_run(run_id)
                run = service.get(run_id)
                if first_reward is None and run.latest_reward is not None:
                    first_reward = time.monotonic() - started
                if run.status in TERMINAL_STATUSES:
                    break
                time.sleep(1)
            wall = time.monotonic() - started
            poller.poll_run(run_id)  # once more: whatever the jobs wrote as they ended
            _wait_for_children_to_exit()
            cpu = _children_cpu_s() - cpu_before
            yield FinishedRun(ctx, root, spec, wall, first_reward, cpu, replica_rss / 2**30)
        finally:
            ctx.db.close()


def replica_start_s(root: Path, run_id: str) -> float:
    """The slowest replica's time from its sidecar listening to its engine ready, from the replica jobs' logs (NaN if
    one never was: the run's status says why)."""
    slowest = 0.0
    for log in (root / "jobs" / run_id).glob("replica-*/log"):
        stamps = {}
        for line in log.read_text(errors="replace").splitlines():
            for mark in ("sidecar listening", "engine ready"):
                if mark in line and mark not in stamps:
                    stamps[mark] = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1e3
        if "engine ready" not in stamps:
            return math.nan
        slowest = max(slowest, stamps["engine ready"] - stamps["sidecar listening"])
    return slowest


def generated_tokens(store: LocalStore, run_id: str, replicas: int) -> int:
    """Tokens the replicas generated over the run, by their last heartbeats."""
    beats = (json.loads(store.get_bytes(layout.status_key(run_id, f"replica-{i}"))) for i in range(replicas))
    return sum(beat["generated_tokens_total"] for beat in beats)


def run_demo(
    steps: int,
    seed: int,
    processes: int = 1,
    sharding: str = "auto",
    limits: str = "auto",
    evaluation: str = "demo",
    engine: str = "cpu",
) -> dict[str, Any]:
    run_id = f"bench-{steps}-{seed}-{processes}-{sharding}"
    grpo: dict[str, Any] = {"max_steps": steps, "seed": seed}
    if limits != "auto":
        inflight, queue = limits.split("/")
        grpo.update(max_inflight=int(inflight), queue_size=int(queue))
    compute: dict[str, Any] = {"trainer_processes": processes, "trainer_sharding": sharding, "engine": engine}
    chosen = EVALUATION[evaluation]
    sections = {"eval": chosen} if chosen else {}
    with finished_run(run_id, lambda name, uri: demo_spec(name, uri, grpo=grpo, compute=compute, **sections)) as run:
        queries = QueryService(run.ctx, "bench")
        summary = queries.summary(run_id)
        use = queries.sample_use(run_id)
        step_times = [v for _, v in queries.metric_series(run_id, "perf/step_s", max_points=None)]
        ratios = [v for _, v in queries.metric_series(run_id, "ratio", max_points=None)]
        lengths = [v for _, v in queries.metric_series(run_id, "completions/mean_length", max_points=None)]
        rollout_tokens = sum(lengths) * run.spec.grpo.completions_per_step
        store = LocalStore(run.root / "store")
        evaluations = read_stream(store, run_id, "eval")
        start_s = replica_start_s(run.root, run_id)
        serving_s = run.wall_s - start_s  # Launch starts the replicas at once; the trainer waits for them
        return {
            "engine": engine,
            "replica_start_s": start_s,
            "tokens_per_s": generated_tokens(store, run_id, run.spec.compute.replicas) / serving_s,
            "replica_rss_gb": run.replica_rss_gb,
            "steps": steps,
            "seed": seed,
            "processes": processes if processes == 1 else f"{processes} ({sharding})",
            "limits": limits,
            "evaluation": evaluation,
            "evaluations": len(evaluations),
            "eval_share": sum(r["tokens"] for r in evaluations) / rollout_tokens if rollout_tokens else 0.0,
            "trained_share": use.trained_share,
            "cpu_s": run.cpu_s,
            "status": summary.run.status,
            "wall_s": run.wall_s,
            "first_reward_s": run.first_reward_s,
            "steps_per_min": steps / run.wall_s * 60,
            "first5": summary.reward_first5,
            "last5": summary.reward_last5,
            "sync_p50": summary.sync_p50,
            "step_p50": statistics.median(step_times) if step_times else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "load": os.getloadavg()[0],
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, nargs="+", default=[30, 40])
    parser.add_argument("--trainer-processes", type=int, nargs="+", default=[1])
    parser.add_argument("--sharding", nargs="+", choices=["ddp", "fsdp"], default=["ddp"])
    parser.add_argument("--limits", nargs="+", default=["auto"], help="in flight/queued pairs, e.g. 64/256, or auto")
    parser.add_argument(
        "--eval", nargs="+", choices=list(EVALUATION), default=["demo"], help="held-out evaluation during the run"
    )
    parser.add_argument("--engine", nargs="+", choices=["cpu", "vllm"], default=["cpu"], help="the replicas' engine")
    args = parser.parse_args()
    print(
        "| steps | seed | engine | trainer processes | in flight/queued | eval | evaluations | eval tokens | status "
        "| replica start | replicas' memory | first reward | wall | steps/min | tokens/s | reward first 5 → last 5 "
        "| trained on | CPU | sync p50 | step p50 | ratio range | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for steps in args.steps:
        for seed in args.seeds:
            layouts = [(n, sharding) for n in args.trainer_processes for sharding in ([] if n == 1 else args.sharding)]
            for (processes, sharding), limits, evaluation, engine in itertools.product(
                [(1, "auto")] * (1 in args.trainer_processes) + layouts, args.limits, args.eval, args.engine
            ):
                r = run_demo(steps, seed, processes, sharding, limits, evaluation, engine)
                print(
                    f"| {r['steps']} | {r['seed']} | {r['engine']} | {r['processes']} | {r['limits']} "
                    f"| {r['evaluation']} | {r['evaluations']} | {r['eval_share']:.1%} | {r['status']} "
                    f"| {r['replica_start_s']:.0f} s | {r['replica_rss_gb']:.1f} GB | {r['first_reward_s']:.0f} s "
                    f"| {r['wall_s']:.0f} s "
                    f"| {r['steps_per_min']:.1f} | {r['tokens_per_s']:.0f} "
                    f"| {r['first5']:.3f} → {r['last5']:.3f} "
                    f"| {r['trained_share']:.0%} | {r['cpu_s']:.0f} s | {r['sync_p50']:.2f} s | {r['step_p50']:.2f} s "
                    f"| {r['ratio_min']:.3f}–{r['ratio_max']:.3f} | {r['load']:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
