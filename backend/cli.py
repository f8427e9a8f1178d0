"""`python -m backend ...`: the panel's services from the command line, for scripts, tests and the demo.

python -m backend demo            run the embedded demo end to end on this machine and report the reward
python -m backend plan --preset math --set compute.replica_flavor=h200x2
                                  print what a launch would submit, as JSON (a dry run: nothing is created)
python -m backend smoke --spec run.json --hf-credential my-token --store-credential my-bucket
                                  one cpu-basic HF job that proves the bucket, the code and the job's URL (cents)
python -m backend export my-run --format parquet
                                  the run's metrics and samples as files pandas reads
python -m backend eval my-run 0 last
                                  score the base model and the last version on the run's held-out prompts

`python -m backend --help` lists every command; `python -m backend COMMAND --help` shows its options and examples.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from backend.api import PanelServices
from backend.context import PanelContext
from backend.credentials.vault import RunCredentials
from backend.database.models import TERMINAL_STATUSES
from backend.ingestion.poller import Poller
from backend.launch import presets
from backend.services.adapters import VersionNotFound
from backend.services.exports import FORMATS
from backend.services.queries import QueryService
from backend.services.runs import RunNotFound, RunService, RunStateError, run_row
from jobs.contract import RunSpec, SpecError, parse_spec
from jobs.secrets import install_log_redaction

LOCAL_OWNER = "local"


def _bar(step: int, total: int, width: int = 30) -> str:
    filled = int(width * min(step, total) / max(total, 1))
    return "#" * filled + "." * (width - filled)


def follow(ctx: PanelContext, run_id: str, poller: Poller, out: TextIO = sys.stdout, interval: float = 1.0) -> str:
    """Poll the run and print one progress line until it ends; Ctrl-C asks it to stop gracefully."""
    service, queries = RunService(ctx, LOCAL_OWNER), QueryService(ctx, LOCAL_OWNER)
    try:
        while True:
            poller.poll_run(run_id)
            run = service.get(run_id)
            rewards = queries.metric_series(run_id, "reward", max_points=None)
            syncs = queries.metric_series(run_id, "perf/weight_sync_s", max_points=None)
            reward = f"{rewards[-1][1]:.3f}" if rewards else "  -  "
            sync = f"{syncs[-1][1]:.2f}s" if syncs else "  -  "
            # The run's own pace (its last steps), not steps over the time this command has watched: a finished
            # run followed for a second is not 80,000 steps a minute.
            step_seconds = queries.step_seconds(run_id)
            rate = f"{60 / step_seconds:5.1f}" if step_seconds else "  -  "
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
    from jobs.demo.preset import agent_demo_spec, demo_spec

    ctx = PanelContext()
    run_id = args.run_id or time.strftime(f"{'agent' if args.agent else 'demo'}-%Y%m%d-%H%M%S")
    spec = (agent_demo_spec if args.agent else demo_spec)(
        run_id,
        f"file://{ctx.folder / 'store'}",
        grpo={"max_steps": args.steps, "seed": args.seed},
        compute={"replicas": args.replicas, "trainer_processes": args.trainer_processes, "engine": args.engine},
    )
    try:
        engine = ctx.local_launcher.replica_engine(spec)
    except ValueError as error:
        print(f"--engine {args.engine}: {error}", file=sys.stderr)
        return 2
    service = RunService(ctx, LOCAL_OWNER)
    service.create(spec)
    print(
        f"demo run {run_id}: {args.replicas} replicas ({engine.reason}), {args.trainer_processes} trainer "
        f"process(es), {args.steps} steps, store {spec.storage.uri}"
    )
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


def _services(args: argparse.Namespace) -> PanelServices:
    return PanelServices(PanelContext(), LOCAL_OWNER)


def launch(args: argparse.Namespace) -> int:
    services = _services(args)
    chosen = _credential_ids(services.ctx, args)
    result = services.preflight(json.loads(Path(args.spec).read_text()), *chosen)
    for message in result.warnings:
        print(f"warning: {message}")
    spec = result.checked_spec
    if spec is None:
        for field, message in result.errors.items():
            print(f"{field}: {message}", file=sys.stderr)
        return 2
    if result.cost_per_hour:
        print(f"estimated cost: ${result.cost_per_hour:.2f}/hour")
    run = services.runs.create(spec, *chosen)
    services.runs.launch(run.id, wait=True)
    return 0 if follow(services.ctx, run.id, Poller(services.ctx)) == "finished" else 1


def plan(args: argparse.Namespace) -> int:
    """Print, as JSON, every job a launch of the spec would submit and the values derived for its hardware."""
    ctx = PanelContext()
    spec = _spec_from_args(args, ctx)
    if spec is None:
        return 2
    run = run_row(spec, LOCAL_OWNER, "draft", *_credential_ids(ctx, args))
    try:
        plan = ctx.plan(run)
    except ValueError as error:  # an engine that cannot run where the replicas would
        print(f"compute.engine: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(full=args.full), indent=2, ensure_ascii=False))
    return 0


def smoke(args: argparse.Namespace) -> int:
    """Prove on HF Jobs, for cents, that the account, the bucket and the network can run this spec's jobs."""
    services = _services(args)
    spec = _spec_from_args(args, services.ctx)
    if spec is None:
        return 2
    chosen = _credential_ids(services.ctx, args)
    try:
        report = services.smoke_test(spec, chosen.store, chosen.hf, on_step=lambda step: print(step.line(), flush=True))
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(report.summary())
    if report.job_url:
        print(f"job: {report.job_url}")
    return 0 if report.ok else 1


def _spec_from_args(args: argparse.Namespace, ctx: PanelContext) -> RunSpec | None:
    """The spec of `--spec FILE` or `--preset NAME`, with every `--set` applied; None (errors printed) if invalid."""
    if args.spec:
        data = json.loads(Path(args.spec).read_text())
    elif args.preset == "math":
        data = presets.math_recipe(args.run_id, args.namespace, args.bucket)
    else:
        data = presets.LOCAL[args.preset or "demo"](args.run_id, f"file://{ctx.folder / 'store'}")
    for assignment in args.set:
        _assign(data, assignment)
    try:
        return parse_spec(data)
    except SpecError as error:
        for field, message in error.errors.items():
            print(f"{field}: {message}", file=sys.stderr)
        return None


def _credential_ids(ctx: PanelContext, args: argparse.Namespace) -> RunCredentials:
    """The credentials named by `--store-credential`, `--hf-credential`, `--wandb-credential` (an id or a saved
    name)."""
    saved = {credential.name: credential.id for credential in ctx.vault.list(LOCAL_OWNER)}

    def resolve(option: str, text: str | None) -> int | None:
        if text is None or text.isdigit():
            return int(text) if text else None
        if text not in saved:
            names = ", ".join(sorted(saved)) or "none saved yet"
            raise SystemExit(f"{option}: no credential named {text!r}; saved: {names}")
        return saved[text]

    return RunCredentials(
        resolve("--store-credential", args.store_credential),
        resolve("--hf-credential", args.hf_credential),
        resolve("--wandb-credential", args.wandb_credential),
    )


def _assign(data: dict[str, Any], assignment: str) -> None:
    """Apply `section.field=value` to a spec dict (the value read as JSON where it parses, else as text)."""
    path, separator, text = assignment.partition("=")
    if not separator or "." not in path:
        raise SystemExit(f"--set {assignment!r}: write section.field=value, e.g. compute.replica_flavor=h200x2")
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    *sections, field = path.split(".")
    target = data
    for section in sections:
        target = target.setdefault(section, {})
    target[field] = value


def list_runs(args: argparse.Namespace) -> int:
    for run in _services(args).runs.list():
        reward = f"{run.latest_reward:.3f}" if run.latest_reward is not None else "-"
        print(f"{run.id:<32} {run.status:<10} step {run.step:>5}/{run.max_steps:<5} reward {reward:>6}  {run.name}")
    return 0


def follow_run(args: argparse.Namespace) -> int:
    ctx = PanelContext()
    return 0 if follow(ctx, args.run, Poller(ctx)) == "finished" else 1


def stop(args: argparse.Namespace) -> int:
    print(_services(args).runs.stop(args.run).status)
    return 0


def relaunch_trainer(args: argparse.Namespace) -> int:
    job = _services(args).runs.relaunch_trainer(args.run)
    print(f"trainer attempt {job.attempt} started ({job.backend_job_id})")
    return 0


def replace_replica(args: argparse.Namespace) -> int:
    job = _services(args).runs.replace_replica(args.run, args.role)
    print(f"{job.role} attempt {job.attempt} is healthy at {job.endpoint}")
    return 0


def versions(args: argparse.Namespace) -> int:
    services = _services(args)
    run = services.runs.get(args.run)
    held_out = {score.version: score.mean for score in services.queries.held_out_series(args.run)}
    for version in services.adapters.versions(args.run):
        marks = " ".join(
            m
            for m, on in (
                ("current", version.version == run.current_version),
                ("best", version.version == run.best_version),
            )
            if on
        )
        reward = f"{version.reward:.3f}" if version.reward is not None else "-"
        scored = f"{held_out[version.version]:.3f}" if version.version in held_out else "-"
        print(
            f"v{version.version:<5} step {version.step!s:>5}  reward {reward:>6}  held-out {scored:>6}  "
            f"{version.size_bytes:>10} B  {marks}"
        )
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """Score versions on the run's held-out prompts and print each with its 95 % interval."""
    services = _services(args)
    numbers = services.evaluation.versions_named(args.run, args.versions)
    changes: dict[str, object] = {"split": args.split, "prompts": args.prompts, "k": args.k}
    if args.greedy:
        changes |= {"greedy": True, "k": args.k or 1}
    chosen = {name: value for name, value in changes.items() if value is not None}
    if args.metric:
        chosen["metrics"] = [_metric(text) for text in args.metric]
    evaluation = services.evaluation.evaluate(args.run, numbers, chosen, on_progress=print)
    report = services.evaluation.report(evaluation)
    if evaluation.job is not None:
        print(f"evaluated on HF Jobs: {evaluation.job.summary()} ({evaluation.job.url})")
    sampling = report["sampling"]
    dropped = (
        f"; {report['shared_with_training']} shared with training dropped" if report["shared_with_training"] else ""
    )
    how = (
        "greedy"
        if sampling["temperature"] == 0
        else f"temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}"
    )
    print(
        f"{report['prompts']} held-out prompts ({report['source']}{dropped}), k={sampling['k']}, {how}, "
        f"seed {sampling['seed']}"
    )
    scores = list(report["versions"][0]["scores"])
    rewards = [name for name in scores if name.startswith("rewards/")]
    # The total first; each reward when there are several (one reward's score is the total); each eval metric.
    names = [scores[0], *(rewards if len(rewards) > 1 else []), *(n for n in scores if n.startswith("metrics/"))]
    print(f"{'version':<8} " + "  ".join(f"{name + ' [95% interval]':<30}" for name in names) + "  pass@k  time")
    for version in report["versions"]:
        cells = [_with_interval(version["scores"][name], "{:.3f}").ljust(30) for name in names]
        passed = version["scores"][names[0]]["pass_at_k"]
        when = "cached" if version["cached"] else f"{version['seconds']:.1f}s"
        label = f"v{version['version']}" + (" base" if version["version"] == 0 else "")
        print(f"{label:<8} " + "  ".join(cells) + f"  {'-' if passed is None else f'{passed:.3f}':>6}  {when}")
    comparison = report["comparison"]
    if comparison is not None:
        a, b = comparison["a"], comparison["b"]
        print(
            f"v{b} - v{a}: {_with_interval(comparison['difference'], '{:+.3f}')} on the same prompts; per prompt v{b} "
            f"higher {comparison['wins']}, equal {comparison['ties']}, lower {comparison['losses']}"
        )
    return 0


def _metric(text: str) -> dict[str, str]:
    """An eval metric from the command line: a built-in's name, or `FILE.py:FUNCTION` (the function in that file)."""
    path, _, function = text.rpartition(":")
    if not path:
        return {"kind": "builtin", "name": text}
    try:
        source = Path(path).read_text()
    except OSError as error:
        raise SystemExit(
            f"--metric: cannot read {path} ({error.strerror}); give FILE.py:FUNCTION or a built-in"
        ) from None
    return {"kind": "code", "name": function, "source": source, "entry_point": function}


def _with_interval(figure: dict[str, float | None], shape: str) -> str:
    """'0.250 [0.180, 0.320]'; an unbounded end (one prompt) as '?'."""
    low, high = (shape.format(figure[end]) if figure[end] is not None else "?" for end in ("low", "high"))
    return f"{shape.format(figure['mean'])} [{low}, {high}]"


def download(args: argparse.Namespace) -> int:
    print(_services(args).adapters.download_zip(args.run, args.version))
    return 0


def _four_places(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def compare(args: argparse.Namespace) -> int:
    result = _services(args).adapters.compare(args.run, args.a, args.b)
    print(
        f"|ΔW| v{args.a} {result.total_norm_a:.4f}   |ΔW| v{args.b} {result.total_norm_b:.4f}   "
        f"|difference| {result.total_diff_norm:.4f}   cosine {_four_places(result.total_cosine)}"
    )
    for module in result.modules:
        print(f"  {module.module:<60} {module.norm_a:9.4f} {module.norm_b:9.4f} {module.diff_norm:9.4f}")
    return 0


def import_bucket(args: argparse.Namespace) -> int:
    imported = _services(args).import_bucket(args.uri, args.endpoint, args.region, args.store_credential)
    print("\n".join(imported) or "nothing new in that bucket")
    return 0


def poll(args: argparse.Namespace) -> int:
    """Poll until SIGINT or SIGTERM, then finish the pass under way and exit 0.

    A signal never lands in the middle of a pass (each pass commits rows and cursors together anyway), and SIGINT
    counts even where the shell started us with it ignored, as it does for background jobs.
    """
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    options = {"chunks_per_pass": args.chunks_per_pass} if args.chunks_per_pass is not None else {}
    poller = Poller(PanelContext(), interval=args.interval, **options).start()
    while not stopping.wait(1.0):
        pass
    poller.stop()
    return 0


def make_current(args: argparse.Namespace) -> int:
    _services(args).adapters.make_current(args.run, args.version)
    print(f"{args.run}: adapters/CURRENT is v{args.version} (later versions are kept)")
    return 0


def branch(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    for assignment in args.set:
        _assign(overrides, assignment)
    child = _services(args).adapters.branch(args.run, args.version, args.new_run_id, overrides, launch=not args.draft)
    print(f"{child.id}: trains on from {args.run} v{args.version} ({child.status})")
    return 0


def publish(args: argparse.Namespace) -> int:
    print(_services(args).adapters.publish(args.run, args.version, args.repo_id, private=not args.public))
    return 0


def export(args: argparse.Namespace) -> int:
    folder = Path(args.out) if args.out else None
    for path in _services(args).exports.export(args.run, args.format, folder):
        print(path)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", help="a spec JSON file")
    source.add_argument("--preset", choices=("demo", "agent", "math"), help="a launch form preset")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--run-id", default="plan-preview", help="for a preset")
    parser.add_argument("--namespace", default="your-username", help="for the math preset")
    parser.add_argument("--bucket", default="grpo", help="for the math preset")
    _add_credential_arguments(parser)


def _add_credential_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store-credential", help="the bucket keys: a saved credential's id or name")
    parser.add_argument("--hf-credential", help="the HF token: a saved credential's id or name")
    parser.add_argument("--wandb-credential", help="the W&B key, to report to W&B: a saved credential's id or name")


def _run_and_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run")
    parser.add_argument("version", type=int, help="an adapter version of the run (`versions RUN` lists them)")


Handler = Callable[[argparse.Namespace], int]


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Handler,
    summary: str,
    *examples: str,
) -> argparse.ArgumentParser:
    """One subcommand with its help line and examples (shown by `python -m backend NAME --help`)."""
    epilog = "examples:\n" + "\n".join(f"  python -m backend {example}" for example in examples) if examples else None
    parser = commands.add_parser(
        name, help=summary, description=summary, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.set_defaults(handler=handler)
    return parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m backend",
        description="The panel's actions from the command line, on the panel's database and data folder.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = _command(
        commands, "demo", demo, "run the embedded demo end to end on this machine", "demo --steps 20"
    )
    demo_parser.add_argument("--steps", type=int, default=40, help="optimizer steps to train (default: %(default)s)")
    demo_parser.add_argument(
        "--replicas", type=int, default=2, help="inference replicas, each a local process (default: %(default)s)"
    )
    demo_parser.add_argument("--seed", type=int, default=42, help="the training seed (default: %(default)s)")
    demo_parser.add_argument(
        "--agent",
        action="store_true",
        help="the agent demo: a model warm-started to call a tool learns that looking the answer up pays",
    )
    demo_parser.add_argument(
        "--trainer-processes",
        type=int,
        default=1,
        help="data-parallel training processes (accelerate launch, gloo on the CPU); 64 completions per step are "
        "split between them (default: %(default)s)",
    )
    demo_parser.add_argument(
        "--engine",
        choices=("cpu", "vllm", "auto"),
        default="cpu",
        help="the replicas' engine: our CPU engine, or vLLM's CPU build (`scripts/setup vllm`), as replicas run on HF "
        "Jobs (default: %(default)s; docs/engines.md compares them)",
    )
    demo_parser.add_argument("--run-id", help="the new run's id (default: demo-YYYYmmdd-HHMMSS, now)")
    launch_parser = _command(
        commands,
        "launch",
        launch,
        "check, create and launch a run from a spec JSON file, then follow it",
        "launch run.json --hf-credential my-token --store-credential my-bucket",
    )
    launch_parser.add_argument("spec")
    _add_credential_arguments(launch_parser)
    plan_parser = _command(
        commands,
        "plan",
        plan,
        "print every job a launch would submit (a dry run), as JSON",
        "plan --preset math --set compute.replica_flavor=h200x2",
    )
    _add_spec_arguments(plan_parser)
    plan_parser.add_argument("--full", action="store_true", help="every argument in full (the bootstrap's source)")
    smoke_parser = _command(
        commands,
        "smoke",
        smoke,
        "run one cpu-basic job on HF Jobs that proves the bucket, the code bundle and the job's URL work",
        "smoke --spec run.json --hf-credential my-token --store-credential my-bucket",
    )
    _add_spec_arguments(smoke_parser)
    _command(commands, "runs", list_runs, "list runs", "runs")
    for name, handler, summary in (
        ("follow", follow_run, "print a run's progress until it ends (Ctrl-C stops it gracefully)"),
        ("stop", stop, "stop a run: the trainer saves its adapter, then every job ends"),
        ("relaunch-trainer", relaunch_trainer, "start the trainer job again; it resumes from its newest checkpoint"),
        ("versions", versions, "list a run's adapter versions with their step and reward"),
    ):
        _command(commands, name, handler, summary, f"{name} my-run").add_argument("run")
    replace = _command(
        commands,
        "replace-replica",
        replace_replica,
        "replace one replica job of a running run",
        "replace-replica my-run replica-1",
    )
    replace.add_argument("run")
    replace.add_argument("role", help="e.g. replica-0")
    download_parser = _command(
        commands,
        "download",
        download,
        "zip one adapter version (with its model card) and print the zip's path",
        "download my-run 40",
    )
    _run_and_version(download_parser)
    eval_parser = _command(
        commands,
        "eval",
        evaluate,
        "score adapter versions on the run's held-out prompts (never trained on), on this machine; two versions are "
        "also compared prompt by prompt. Results are kept in the run's bucket: asking again reads them back",
        "eval my-run 0 last",
        "eval my-run all --k 8",
        "eval my-run 0 every:10 best-reward",
        "eval my-run 20 40 --split test --greedy",
        "eval my-run last --metric exact.py:exact_match",
    )
    eval_parser.add_argument("run")
    eval_parser.add_argument(
        "versions",
        nargs="+",
        help="version numbers (0: the base model), last, all, every:N (every Nth version and the last) or best-reward "
        "(the highest training reward)",
    )
    eval_parser.add_argument("--split", help="a held-out split of the run's dataset (default: the run's eval settings)")
    eval_parser.add_argument("--prompts", type=int, help="how many held-out prompts (default: the run's, 128)")
    eval_parser.add_argument("--k", type=int, help="completions per prompt (default: the run's, 4)")
    eval_parser.add_argument("--greedy", action="store_true", help="one greedy completion per prompt")
    eval_parser.add_argument(
        "--metric",
        action="append",
        help="an eval metric, scored beside the rewards and never trained on: a built-in (e.g. math_boxed) or "
        "FILE.py:FUNCTION; repeat for several (default: the run's)",
    )
    compare_parser = _command(
        commands, "compare", compare, "compare two adapter versions, module by module", "compare my-run 20 40"
    )
    compare_parser.add_argument("run")
    compare_parser.add_argument("a", type=int)
    compare_parser.add_argument("b", type=int)
    current = _command(
        commands,
        "make-current",
        make_current,
        "roll back: point the run's adapters/CURRENT at an earlier version (later ones are kept)",
        "make-current my-run 20",
    )
    _run_and_version(current)
    branch_parser = _command(
        commands,
        "branch",
        branch,
        "start a new run that trains on from one version of a run, with its settings unless --set says otherwise",
        "branch my-run 20 my-run-lr-low --set grpo.learning_rate=1e-5",
        "branch my-run 20 my-run-b --draft",
    )
    _run_and_version(branch_parser)
    branch_parser.add_argument("new_run_id")
    branch_parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    branch_parser.add_argument("--draft", action="store_true", help="create the branch without launching it")
    publish_parser = _command(
        commands,
        "publish",
        publish,
        "upload one adapter version with its model card to a Hub model repo (private unless --public); "
        "uses the run's HF token",
        "publish my-run 40 my-user/my-adapter",
    )
    _run_and_version(publish_parser)
    publish_parser.add_argument("repo_id")
    publish_parser.add_argument("--public", action="store_true")
    export_parser = _command(
        commands,
        "export",
        export,
        "write a run's metrics (one row per step, TRL's names) and samples as CSV or Parquet; prints the paths",
        "export my-run --format parquet --out ./exports",
    )
    export_parser.add_argument("run")
    export_parser.add_argument("--format", choices=FORMATS, default="csv")
    export_parser.add_argument("--out", help="the folder to write into (default: the panel's exports folder)")
    import_parser = _command(
        commands,
        "import",
        import_bucket,
        "import the runs a bucket holds",
        "import s3://my-bucket/panel --endpoint https://...",
    )
    import_parser.add_argument("uri")
    import_parser.add_argument("--endpoint")
    import_parser.add_argument("--region")
    import_parser.add_argument("--store-credential", type=int)
    poll_parser = _command(commands, "poll", poll, "run the poller in the foreground", "poll --interval 5")
    poll_parser.add_argument("--interval", type=float, default=2.0, help="seconds between passes")
    poll_parser.add_argument(
        "--chunks-per-pass",
        type=_positive_int,
        help="at most this many telemetry chunks per stream and run in one pass (default: the poller's own)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    install_log_redaction()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = _build_parser().parse_args(argv)
        handler: Handler = args.handler  # set by `_command`
        return handler(args)
    except BrokenPipeError:
        # The reader went away (`python -m backend versions my-run | head`) with what it wanted. Point stdout at
        # /dev/null, or flushing it at exit raises again, and end as a program SIGPIPE ended.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (RunNotFound, VersionNotFound, RunStateError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
