"""The proxy as a child of the trainer job, and the watchdog that notices when every replica is gone.

The proxy runs in its own process so routing never competes with the training loop for the GIL. The trainer talks to
it at 127.0.0.1 as if it were one vLLM server.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, cast

import requests

if TYPE_CHECKING:
    from jobs.proxy.upstreams import ReplicaView  # the body of GET /proxy/replicas

log = logging.getLogger(__name__)


class ProxyUnavailable(RuntimeError):
    pass


class ProxyProcess:
    def __init__(self, spec_uri: str, port: int, store_endpoint: str | None = None, store_region: str | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.command = [sys.executable, "-m", "jobs.proxy", "--spec", spec_uri, "--port", str(port)]
        if store_endpoint:
            self.command += ["--store-endpoint", store_endpoint]
        if store_region:
            self.command += ["--store-region", store_region]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ProxyProcess:
        self.process = subprocess.Popen(self.command)
        return self

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout: float, on_wait: Callable[[float], None] | None = None) -> None:
        """Block until at least the minimum of replicas answers through the proxy, or raise after `timeout` s."""
        started = time.monotonic()
        while not self.healthy():
            if self.process is not None and self.process.poll() is not None:
                raise ProxyUnavailable(f"the proxy exited with code {self.process.returncode} at start; see its log")
            waited = time.monotonic() - started
            if waited > timeout:
                raise ProxyUnavailable(f"no replica became healthy within {timeout:.0f}s; check the replica jobs' logs")
            if on_wait is not None:
                on_wait(waited)
            time.sleep(1.0)

    def replicas(self) -> list[ReplicaView]:
        """Healthy replicas as the proxy sees them: [{"role", "url", ...}]."""
        response = requests.get(self.url + "/proxy/replicas", timeout=10)
        response.raise_for_status()
        body = response.json()
        replicas: list[ReplicaView] = body["replicas"] if isinstance(body, dict) else body
        return [replica for replica in replicas if replica.get("healthy", True)]  # an ejected one is not healthy

    def eject(self, role: str, reason: str) -> None:
        """Take a replica out of rotation; the proxy re-admits it at a later health check after unloading everything
        it holds and loading every live version afresh (a clean re-load). Raises on failure."""
        response = requests.post(f"{self.url}/proxy/replicas/{role}/eject", json={"reason": reason}, timeout=10)
        response.raise_for_status()

    def post_step(self, step: int) -> None:
        """Tell the proxy the optimizer step, which it stamps into the next adapter version it publishes."""
        try:
            requests.post(self.url + "/proxy/trainer_state", json={"step": step}, timeout=5)
        except requests.RequestException as error:
            log.warning("could not tell the proxy the step: %s", error)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class TrainingInterrupted(RuntimeError):
    """Raised in the training thread by a `Watchdog`: the run cannot go on; the message says why and what to do."""


class ReplicasLost(TrainingInterrupted):
    """No replica has answered for too long."""


class StoreUnreachable(TrainingInterrupted):
    """The run's bucket has refused or ignored every call for too long."""


class Watchdog:
    """Interrupts training once `ok()` has been false for `timeout` seconds in a row.

    TRL retries a failing generation for ~20 minutes before its rollout worker dies, and a store outage stalls every
    sync, while the replicas keep billing; a run that cannot go on should fail within a bounded, configurable time
    instead. The watchdog raises its error in the main thread through a signal, the one way to interrupt a thread
    blocked in a queue.
    """

    _pending: TrainingInterrupted | None = None  # what the next SIGUSR1 raises (the first watchdog to fire wins)

    def __init__(self, ok: Callable[[], bool], timeout: float, error: TrainingInterrupted, interval: float = 5.0):
        self.ok, self.timeout, self.error, self.interval = ok, timeout, error, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-{type(error).__name__}", daemon=True)

    def start(self) -> Watchdog:
        signal.signal(signal.SIGUSR1, _raise_pending)
        self._thread.start()
        return self

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self.interval):
            if self._healthy():
                failing_since = None
                continue
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= self.timeout and Watchdog._pending is None:
                log.error("%s", self.error)
                Watchdog._pending = self.error
                main_thread = cast(int, threading.main_thread().ident)  # the main thread has always started: never None
                signal.pthread_kill(main_thread, signal.SIGUSR1)
                return

    def _healthy(self) -> bool:
        try:
            return self.ok()
        except Exception:  # a check that cannot even be made counts as failing
            return False

    def stop(self) -> None:
        self._stop.set()


def _raise_pending(_signum: int, _frame: FrameType | None) -> None:
    raise Watchdog._pending or TrainingInterrupted("interrupted")


def replica_watchdog(proxy: ProxyProcess, timeout: float) -> Watchdog:
    """Fails the run when the proxy has had no healthy replica for `timeout` seconds."""
    reason = (
        f"no replica has answered for {timeout:.0f}s; the run cannot generate rollouts. "
        "Check the replica jobs (they may have been stopped, preempted or crashed) and relaunch"
    )
    return Watchdog(proxy.healthy, timeout, ReplicasLost(reason))
