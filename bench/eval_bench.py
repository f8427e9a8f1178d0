"""Time to evaluate stored versions after a run on the embedded default, by held-out prompt count (issue 29).

    .venv/bin/python bench/eval_bench.py                  # 5 versions x {32, 128} prompts x k=4, then read back

The demo's own held-out split has 32 prompts, so this trains a short demo on a dataset file of 160 prompts (the demo's
instructions about 20 things) with 128 rows carved off for evaluation, then evaluates the same 5 versions on the first
32 and on all 128 held-out prompts (each a fresh evaluation: the prompt count is part of what a result depends on), and
asks for the 128 again (read back from the bucket). Wall and CPU time of this process and its children, side by side
in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NOUNS = (
    "apple", "river", "stone", "cloud", "forest", "window", "garden", "candle", "bridge", "lamp",
    "mountain", "pencil", "harbor", "violin", "desert", "mirror", "island", "ladder", "meadow", "kettle",
)  # fmt: skip


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--versions", type=int, nargs="+", default=[1, 3, 5, 7, 9])
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    os.environ["GRPO_PANEL_DATA"] = str(folder / "panel")

    from backend.context import PanelContext
    from backend.ingestion.poller import Poller
    from backend.services.evaluation import EvaluationService
    from backend.services.runs import RunService
    from jobs.demo.dataset import INSTRUCTIONS
    from jobs.demo.preset import demo_spec
    from jobs.store import LocalStore
    from tests.support.runs import follow_to_end

    ctx = PanelContext()
    store_root = folder / "store"
    rows = [{"prompt": f"{instruction} {noun}", "answer": ""} for noun in NOUNS for instruction in INSTRUCTIONS]
    LocalStore(store_root).put_bytes("data/digits-160.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = demo_spec(
        "eval-bench",
        f"file://{store_root}",
        dataset={"source": "store", "id": "data/digits-160.jsonl", "split": "train"},
        eval={"holdout": 128, "during_run": False},
        grpo={"max_steps": args.steps, "seed": 0},
    )
    runs = RunService(ctx, "local")
    runs.create(spec)
    runs.launch(spec.run_id, wait=True)
    run = follow_to_end(Poller(ctx), runs, spec.run_id, timeout=1800)
    assert run.status == "finished", run.status_message
    evaluation = EvaluationService(ctx, "local")
    versions = ", ".join(f"v{version}" for version in args.versions)
    print(f"{len(args.versions)} versions ({versions}), k=4, one CPU engine started for each evaluation")
    print("| prompts | wall | CPU | cached | held-out reward of the last |")
    print("|---:|---:|---:|---|---:|")
    for prompts in (32, 128, 128):
        wall, cpu = time.monotonic(), cpu_seconds()
        result = evaluation.evaluate(spec.run_id, args.versions, {"prompts": prompts})
        wall, cpu = time.monotonic() - wall, cpu_seconds() - cpu
        last = result.results[-1].summary("reward").avg.mean
        print(f"| {prompts} | {wall:.1f} s | {cpu:.1f} s | {all(result.cached)} | {last:.3f} |")


if __name__ == "__main__":
    main()
