"""`python -m jobs.proxy --spec <spec URI> [--port 8000] [--upstream URL ...]`: run the proxy until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable

from jobs import settings
from jobs.contract import RunSpec
from jobs.proxy.app import Proxy
from jobs.proxy.config import ProxyConfig, add_arguments, from_arguments
from jobs.runtime import add_run_arguments, open_run, setup_logging
from jobs.store import ObjectNotFound, ObjectStore, StoreError

log = logging.getLogger("jobs.proxy")

# Allocations between two collections of young objects (Python's default: 700). Each request in flight holds tasks,
# futures and parser state for tens of milliseconds, so at the default the collector walks the same live objects
# several times before they die; every 50,000 it finds them mostly gone. Measured side by side
# (docs/benchmarks/proxy.md): ~12 % less CPU per relayed request; one collection takes at most ~1.3 ms.
YOUNG_COLLECTION_EVERY = 50_000


async def serve(config: ProxyConfig, spec: RunSpec, store: ObjectStore, upstream_token: str | None) -> None:
    """Run a proxy until the process is asked to stop; then stop it cleanly (a last telemetry snapshot included)."""
    proxy = Proxy(config, spec, store, upstream_token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await proxy.start()
    # Everything allocated so far (boto3, pydantic, ...) lives as long as the process: keep it out of garbage
    # collections, which would otherwise walk it every time (~15 ms, a pause for every request in flight).
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await proxy.stop()


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (the vLLM job image and requirements.txt bring it), else asyncio's.

    It takes about an eighth off the proxy's CPU time per relayed request (bench/proxy_bench.py measures both side
    by side); nothing in the proxy depends on which loop runs it."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.proxy",
        description="Route TRL's vLLM calls to a pool of replicas: prefix affinity, adapter publishing and broadcast.",
    )
    add_run_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging("proxy")
    try:
        config = from_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        context = open_run(args.spec, args.store_endpoint, args.store_region)
    except ObjectNotFound:
        log.error("there is no spec.json at %s; check --spec (and --store-endpoint for S3)", args.spec)
        return 2
    except (StoreError, ValueError) as error:
        log.error("cannot open the run at %s: %s", args.spec, error)
        return 2
    token = settings.UPSTREAM_TOKEN.get()
    if token is None:
        log.warning("%s is not set: upstream requests carry no Authorization header", settings.UPSTREAM_TOKEN.name)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(serve(config, context.spec, context.store, token))
    except OSError as error:
        log.error("cannot listen on 127.0.0.1:%d: %s", config.port, error.strerror or error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
