"""The held-out evaluator (jobs/evaluation/during_run.py) as a child of the trainer job, kept alive beside training.

It is a process of its own so that tokenising, sampling and scoring never take the training loop's GIL. Whatever it
does, training goes on: an evaluator that exits early is started again (a few times, each said as an event), and at
the end it gets a bounded time to score the last version before it is stopped. What it prints on stdout (skips,
failures) becomes the run's events; each version's scores, the run's Trackio and W&B reports (`on_scores`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

log = logging.getLogger(__name__)
RESTARTS = 3  # an evaluator that keeps dying is left dead: the run's training matters more
CHECK_EVERY_S = 5.0
# How long the trainer waits, with its replicas still up, for the last version's evaluation: a few hundred held-out
# completions, on replicas that no longer train.
FINISH_TIMEOUT_S = 300.0
FORWARD_END_S = 10.0  # how long the evaluator's last lines may take to be read once it has exited


class Events(Protocol):
    def event(self, kind: str, message: str, level: str = "info") -> None: ...


def evaluator_command(
    spec_uri: str, proxy_url: str, final_file: Path, store_endpoint: str | None, store_region: str | None
) -> list[str]:
    command = [sys.executable, "-m", "jobs.evaluation", "--spec", spec_uri, "--proxy", proxy_url]
    command += ["--final-file", str(final_file)]
    if store_endpoint:
        command += ["--store-endpoint", store_endpoint]
    if store_region:
        command += ["--store-region", store_region]
    return command


class EvaluatorProcess:
    def __init__(
        self,
        command: list[str],
        final_file: Path,
        events: Events,
        check_every: float = CHECK_EVERY_S,
        on_scores: Callable[[dict[str, Any]], None] | None = None,
    ):
        """`on_scores` is given each version's held-out record (jobs/evaluation/during_run.py's `telemetry_record`) as
        it is stored, for reporting elsewhere than the panel (which reads the `eval` stream)."""
        self.command, self.final_file, self.events, self.check_every = command, final_file, events, check_every
        self.on_scores = on_scores
        self.process: subprocess.Popen[str] | None = None
        self._forwarder: threading.Thread | None = None  # reads the running evaluator's notices
        self.restarts = 0
        self._finishing = threading.Event()
        self._lock = threading.Lock()  # a restart and a stop never cross: no evaluator outlives the trainer
        self._watcher = threading.Thread(target=self._watch, name="evaluator-watch", daemon=True)

    def start(self) -> EvaluatorProcess:
        self.final_file.unlink(missing_ok=True)  # a resumed attempt's last version is not this one's
        self._spawn()
        self._watcher.start()
        return self

    def _spawn(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        self._forwarder = threading.Thread(target=self._forward, args=(self.process.stdout,), daemon=True)
        self._forwarder.start()

    def _forward(self, stdout: IO[str] | None) -> None:
        """The evaluator's notices as events of the run (read to the end: a full pipe would block the evaluator)."""
        for line in stdout or ():
            try:
                notice = json.loads(line)
                if isinstance(notice.get("scores"), dict):
                    if self.on_scores is not None:
                        self.on_scores(notice["scores"])
                    continue
                kind, level = str(notice.get("kind", "evaluation")), str(notice.get("level", "info"))
                self.events.event(kind, str(notice["message"]), level=level)
            except (ValueError, KeyError, TypeError, AttributeError):
                log.info("evaluator: %s", line.rstrip())
            except Exception:  # an event that could not be recorded: the next one may be
                log.exception("forwarding the evaluator's notice failed")

    def _watch(self) -> None:
        """Start the evaluator again when it exits before it was asked to finish."""
        while not self._finishing.wait(self.check_every):
            try:
                if not self._restart_if_exited():
                    return
            except Exception:  # a failed start is tried again at the next check
                log.exception("restarting the held-out evaluator failed")

    def _restart_if_exited(self) -> bool:
        """Start an evaluator that exited early again; False once it has died too often to be worth it."""
        with self._lock:
            process = self.process
            if process is None or process.poll() is None or self._finishing.is_set():
                return True
            if self.restarts >= RESTARTS:
                self.events.event(
                    "evaluation",
                    f"the held-out evaluator exited with code {process.returncode} {RESTARTS + 1} times; no more "
                    "versions are evaluated during this run (training goes on; evaluate them from the Adapters page)",
                    level="warning",
                )
                return False
            self.restarts += 1
            self.events.event(
                "evaluation",
                f"the held-out evaluator exited with code {process.returncode}; started again "
                f"({self.restarts} of {RESTARTS})",
                level="warning",
            )
            self._spawn()
            return True

    def finish(
        self, last_version: int, timeout: float = FINISH_TIMEOUT_S, cancelled: Callable[[], bool] = lambda: False
    ) -> None:
        """Let the evaluator score `last_version` within `timeout` seconds (less if the job is `cancelled`
        meanwhile), then end it. Returns once what it said is forwarded: the last version's scores, which the trainer
        reports next, are among its last lines."""
        with self._lock:
            self._finishing.set()
            process = self.process
        self.final_file.write_text(str(last_version))
        deadline = time.monotonic() + timeout
        while process is not None and process.poll() is None and not cancelled():
            if time.monotonic() >= deadline:
                self.events.event(
                    "evaluation",
                    f"the held-out evaluation of the last version v{last_version} did not end within {timeout:.0f} s "
                    "and was stopped; evaluate it from the Adapters page",
                    level="warning",
                )
                break
            time.sleep(0.2)
        self.stop()

    def stop(self) -> None:
        """End the evaluator, and read what it said to the end."""
        with self._lock:
            self._finishing.set()
            process, forwarder = self.process, self._forwarder
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if forwarder is not None:
            forwarder.join(timeout=FORWARD_END_S)  # at the end of its output: at once, unless a child holds the pipe
