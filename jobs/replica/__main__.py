"""Entry point of a replica job: `python -m jobs.replica --spec <spec URI> --index <i>`.

Starts the sidecar on the public port at once (so the platform sees the port open and `/health` answers 503 until
the engine is ready), then the engine as a child process in its own process group, and writes the heartbeat. On
SIGTERM or SIGINT it stops listening, terminates the engine's whole process group (SIGKILL after a grace period),
deletes the adapters it downloaded, writes a last heartbeat (`stopped`) and exits 0. If the engine dies or never
becomes ready, the heartbeat says `failed` with the reason and the exit code is 1, so the launcher sees the failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable
from pathlib import Path

from aiohttp import web

from jobs import settings
from jobs.models import resolve_model
from jobs.ports import free_port
from jobs.processes import terminate_group
from jobs.replica.engine_command import choose_engine, engine_command
from jobs.replica.heartbeat import Heartbeat
from jobs.replica.sidecar import Sidecar
from jobs.runtime import RunContext, add_run_arguments, open_run, setup_logging

log = logging.getLogger("jobs.replica")
ENGINE_STOP_GRACE_S = 20.0
_PR_SET_PDEATHSIG = 1
# Looked up here, not in the forked child, where importing or loading a library could deadlock on a lock held by
# another thread at fork time.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.replica", description="Run one inference replica of a run.")
    add_run_arguments(parser)
    parser.add_argument("--index", type=int, required=True, help="replica number (its heartbeat is replica-<index>)")
    parser.add_argument("--host", default="0.0.0.0", help="address of the public port (the sidecar)")
    parser.add_argument("--port", type=int, default=8000, help="the public port (the sidecar)")
    parser.add_argument("--engine", choices=["auto", "vllm", "cpu"], default=None, help="default: compute.engine")
    parser.add_argument("--engine-port", type=int, default=0, help="the engine's port on 127.0.0.1 (default: free)")
    parser.add_argument("--engine-threads", type=int, default=1, help="torch threads of the CPU engine")
    parser.add_argument("--engine-start-timeout", type=float, default=1800.0, help="seconds to wait for the engine")
    parser.add_argument(
        "--adapter-cache", type=Path, default=None, help="folder for downloaded adapters (default: temp)"
    )
    parser.add_argument("--heartbeat-interval", type=float, default=5.0, help="seconds between heartbeats")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    role = f"replica-{args.index}"
    setup_logging(role)
    try:
        context = open_run(args.spec, args.store_endpoint, args.store_region)
    except Exception as error:
        log.error(
            "cannot read the run's spec at %s (%s: %s); check the URI, --store-endpoint and the store credentials",
            args.spec,
            type(error).__name__,
            error,
        )
        return 2
    return asyncio.run(ReplicaJob(args, context, role).run())


class ReplicaJob:
    def __init__(self, args: argparse.Namespace, context: RunContext, role: str):
        self.args = args
        self.spec = context.spec
        self.store = context.store
        self.role = role
        self.own_cache = args.adapter_cache is None
        self.cache_root = Path(tempfile.mkdtemp(prefix=f"{role}-adapters-")) if self.own_cache else args.adapter_cache
        self.sidecar = Sidecar(
            engine_url="",  # set once the engine port is known
            store=self.store,
            max_staleness=self.spec.grpo.max_staleness,
            cache_root=self.cache_root,
            token=settings.REPLICA_TOKEN.get(),
            fault=settings.FAULT_SERVE_PREVIOUS_ADAPTER.get(),
        )
        self.engine: asyncio.subprocess.Process | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        engine_port = self.args.engine_port or free_port()
        self.sidecar.engine_url = f"http://127.0.0.1:{engine_port}"
        runner = web.AppRunner(self.sidecar.app(), access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, self.args.host, self.args.port)
        await site.start()
        log.info("sidecar listening on %s:%d; engine port %d", self.args.host, self.args.port, engine_port)

        exit_code, final_state = 1, "failed"
        requested = self.args.engine or self.spec.compute.engine
        self.heartbeat = Heartbeat(
            self.store,
            self.spec.run_id,
            self.role,
            requested,
            self.spec.model.id,
            self.sidecar,
            self.args.heartbeat_interval,
        )
        beating = asyncio.create_task(self.heartbeat.run())
        try:
            choice = choose_engine(requested)
            self.heartbeat.engine = choice.engine
            log.info("engine: %s (%s)", choice.engine, choice.reason)
            model_path = await asyncio.to_thread(resolve_model, self.spec.model)
            command = engine_command(choice, self.spec, model_path, engine_port, self.args.engine_threads)
            log.info("starting the %s engine: %s", choice.engine, " ".join(command.argv))
            self.engine = await asyncio.create_subprocess_exec(
                *command.argv, env=command.env, start_new_session=True, preexec_fn=_die_with_parent
            )
            outcome = await _first(
                stopped=stop.wait(),
                exited=self.engine.wait(),
                ready=self._wait_ready(self.args.engine_start_timeout),
            )
            if outcome == "ready":
                log.info("engine ready; replica %s is serving", self.role)
                self.heartbeat.state = "ready"
                await self.heartbeat.beat()
                outcome = await _first(stopped=stop.wait(), exited=self.engine.wait())
            if outcome == "stopped":
                exit_code, final_state = 0, "stopped"
            elif outcome == "exited":
                self.sidecar.note_error(f"the engine exited with code {self.engine.returncode}")
            else:
                self.sidecar.note_error(f"the engine was not ready within {self.args.engine_start_timeout:.0f}s")
        except Exception as error:
            self.sidecar.note_error(f"replica failed: {error}", exc_info=True)

        self.heartbeat.state = "stopping"
        await site.stop()
        await self._stop_engine()
        await runner.cleanup()
        await self.sidecar.remove_cache()
        if self.own_cache:
            shutil.rmtree(self.cache_root, ignore_errors=True)
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        self.heartbeat.state = final_state
        await self.heartbeat.beat()
        (log.info if exit_code == 0 else log.error)("replica %s %s", self.role, final_state)
        return exit_code

    async def _wait_ready(self, timeout: float) -> None:
        """Return once the engine answers /health with 200; raise TimeoutError after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(Exception):
                    status, _ = await self.sidecar.engine_get("/health", timeout=5.0)
                    if status == 200:
                        return
                await asyncio.sleep(0.5)

    async def _stop_engine(self) -> None:
        """SIGTERM the engine's process group (vLLM and its workers), SIGKILL whatever is left after the grace."""
        if self.engine is None:
            return
        if await asyncio.to_thread(terminate_group, self.engine.pid, ENGINE_STOP_GRACE_S):
            log.warning("the engine ignored SIGTERM for %.0fs; killed it", ENGINE_STOP_GRACE_S)
        await self.engine.wait()


async def _first(**awaitables: Awaitable[object]) -> str:
    """Run the awaitables concurrently; return the name of the first to finish (TimeoutError counts as 'timeout')."""
    tasks = {asyncio.ensure_future(aw): name for name, aw in awaitables.items()}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    task = next(iter(done))
    error = None if task.cancelled() else task.exception()
    if isinstance(error, TimeoutError):
        return "timeout"
    if error is not None:
        raise error
    return tasks[task]


def _die_with_parent() -> None:
    """In the engine child before exec: get SIGTERM if the replica dies without cleaning up (Linux only)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
