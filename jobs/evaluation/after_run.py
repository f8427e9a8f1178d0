"""The evaluator job on HF Jobs: stored versions of a finished run scored on a machine that can serve its model.

The panel evaluates the embedded default's versions on its own CPU; a model that needs a GPU is evaluated by one job
of the replicas' kind (their image and flavor), which reads what it is asked from the bucket (the spec to evaluate
with and the versions: `layout.eval_request_key`), starts an engine of its own, scores each version with the run's
rewards and metrics as the trainer builds them, stores each result under its key as it goes, and ends. The panel
reads the results back from the bucket.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from jobs.contract import RunSpec, layout, parse_spec
from jobs.evaluation.during_run import scoring
from jobs.evaluation.engine import local_engine
from jobs.evaluation.heldout import held_out
from jobs.evaluation.results import result_key
from jobs.evaluation.sampling import Sampling
from jobs.evaluation.versions import evaluate_versions
from jobs.pins import install_missing
from jobs.runtime import add_run_arguments, open_run, setup_logging
from jobs.store import ObjectStore, download_published

log = logging.getLogger("jobs.evaluation.after_run")
ENGINE_START_S = 1800.0  # vLLM pulls and loads a large model before it answers


def evaluate_request(spec: RunSpec, versions: list[int], store: ObjectStore) -> str:
    """Evaluate `versions` of the run with `spec`'s eval settings; the key the results are stored under."""
    from jobs.models import resolve_model
    from jobs.replica.engine_command import choose_engine

    held = held_out(spec, store)
    sampling = Sampling.of(spec)
    key = result_key(spec, held, sampling)
    model_path = resolve_model(spec.model)
    install_missing(spec.environment.packages, "for the environment's code")  # the job image lacks them
    prompts, scorer = scoring(spec, held, model_path)
    engine = choose_engine(spec.compute.engine)
    log.info("evaluating %s on %d held-out prompts: %s", versions, len(prompts.records), engine.reason)
    with local_engine(spec, model_path, engine, ENGINE_START_S) as url, tempfile.TemporaryDirectory() as folder:

        def adapter_dir(version: int) -> Path:
            target = Path(folder) / f"v{version}"
            download_published(store, layout.adapter_prefix(spec.run_id, version), target)
            return target

        for version, result in evaluate_versions(
            url, spec, prompts, sampling, key, versions, adapter_dir, scorer.score, store
        ).items():
            log.info("v%d: held-out reward %.3f in %.1f s", version, result.summary("reward").avg.mean, result.seconds)
    return key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.evaluation.after_run", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--request", required=True, help="the request's key in the bucket (layout.eval_request_key)")
    args = parser.parse_args(argv)
    setup_logging("evaluator")
    ctx = open_run(args.spec, args.store_endpoint, args.store_region)
    request = json.loads(ctx.store.get_bytes(args.request))
    spec = parse_spec(request["spec"], stored=True)
    if spec.run_id != ctx.spec.run_id:
        raise SystemExit(f"the request names run {spec.run_id}, the job runs for {ctx.spec.run_id}")
    evaluate_request(spec, [int(version) for version in request["versions"]], ctx.store)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
