"""`python -m backend ...`: the panel's services from the command line, for scripts, tests and the demo.

python -m backend demo            run the embedded demo end to end on this machine and report the reward
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from backend.context import PanelContext
from backend.poller import Poller
from backend.services.queries import QueryService
from backend.services.runs import TERMINAL_STATUSES, RunService
from jobs.secrets import install_log_redaction

LOCAL_OWNER = "local"


def _bar(step: int, total: int, width: int = 30) -> str:
    filled = int(width * min(step, total) / max(total, 1))
    return "#" * filled + "." * (width - filled)


def follow(ctx: PanelContext, run_id: str, poller: Poller, out=sys.stdout, interval: float = 1.0) -> str:
    """Poll the run and print one progress line until it ends; Ctrl-C asks it to stop gracefully."""
    service, queries = RunService(ctx, LOCAL_OWNER), QueryService(ctx, LOCAL_OWNER)
    started = time.monotonic()
    try:
        while True:
            poller.poll_run(run_id)
            run = service.get(run_id)
            rewards = queries.metric_series(run_id, "reward", max_points=None)
            syncs = queries.metric_series(run_id, "perf/weight_sync_s", max_points=None)
            minutes = (time.monotonic() - started) / 60
            reward = f"{rewards[-1][1]:.3f}" if rewards else "  -  "
            sync = f"{syncs[-1][1]:.2f}s" if syncs else "  -  "
            rate = f"{run.step / minutes:5.1f}" if minutes > 0 else "  -  "
            out.write(
                f"\r[{_bar(run.step, run.max_steps)}] step {run.step:>4}/{run.max_steps}  reward {reward}  "
                f"sync {sync}  {rate} steps/min  {run.status:<10}"
            )
            out.flush()
            if run.status in TERMINAL_STATUSES:
                out.write("\n")
                return run.status
            time.sleep(interval)
    except KeyboardInterrupt:
        out.write("\nstopping the run (it saves a checkpoint first)...\n")
        service.stop(run_id, "interrupted from the command line")
        return follow(ctx, run_id, poller, out, interval)


def demo(args: argparse.Namespace) -> int:
    from jobs.demo.preset import demo_spec

    ctx = PanelContext()
    run_id = args.run_id or time.strftime("demo-%Y%m%d-%H%M%S")
    spec = demo_spec(
        run_id,
        f"file://{ctx.folder / 'store'}",
        grpo={"max_steps": args.steps, "seed": args.seed},
        compute={"replicas": args.replicas},
    )
    service = RunService(ctx, LOCAL_OWNER)
    service.create(spec)
    print(f"demo run {run_id}: {args.replicas} CPU replicas, {args.steps} steps, store {spec.storage.uri}")
    started = time.monotonic()
    service.launch(run_id, wait=True)
    status = follow(ctx, run_id, Poller(ctx))
    summary = QueryService(ctx, LOCAL_OWNER).summary(run_id)
    wall = time.monotonic() - started
    print(f"run {run_id} {status} in {wall:.0f}s ({summary.steps} steps, {summary.steps / wall * 60:.1f} steps/min)")
    if summary.reward_first5 is not None:
        print(f"reward: first 5 steps {summary.reward_first5:.3f} -> last 5 steps {summary.reward_last5:.3f}")
    if summary.sync_p50 is not None:
        print(f"adapter sync p50: {summary.sync_p50:.2f}s; {summary.versions} adapter versions in the store")
    if status != "finished":
        print(f"status: {summary.run.status_message}")
    return 0 if status == "finished" else 1


def main(argv: list[str] | None = None) -> int:
    install_log_redaction()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m backend")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="run the embedded demo end to end on this machine")
    demo_parser.add_argument("--steps", type=int, default=40)
    demo_parser.add_argument("--replicas", type=int, default=2)
    demo_parser.add_argument("--seed", type=int, default=42)
    demo_parser.add_argument("--run-id")
    demo_parser.set_defaults(handler=demo)
    args = parser.parse_args(argv)
    return args.handler(args)
