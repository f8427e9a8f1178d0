"""Callbacks that let the outside steer a running trainer: graceful stop, and the step hint for the proxy."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from jobs.contract import layout
from jobs.contract.control import STOP, StopRequest
from jobs.store import ObjectStore, StoreError
from jobs.trainer import ranks
from jobs.trainer.callback import Callback

if TYPE_CHECKING:
    from jobs.trainer.telemetry import Telemetry

log = logging.getLogger(__name__)


class GracefulStop(Callback):
    """Stops training after the current step, with a checkpoint, when asked.

    Asked means a stop request in the store (`control/stop.json`, written by the panel) or a first SIGTERM (a job
    being cancelled). A second SIGTERM is not caught: the default handler ends the process at once.

    With several training processes the main one decides, after every step, and every rank follows: ranks that
    looked for themselves could stop at different steps, and the ones still training would wait forever in the next
    collective. Every rank catches the first SIGTERM (a cancelled job's agent signals them all): a rank that died at
    once would leave the main one blocked in a collective, with no checkpoint (each rank writes its own RNG state
    into it) and its replicas still running.
    """

    def __init__(self, store: ObjectStore, run_id: str, telemetry: Telemetry | None = None, check_every: float = 5.0):
        self.store, self.run_id, self.telemetry, self.check_every = store, run_id, telemetry, check_every
        self.reason: str | None = None
        self.cancelled = False  # the job received SIGTERM: it is being cancelled, and should end soon
        self._checked = 0.0
        self._signalled = threading.Event()

    def install_signal_handler(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, _signum: int, _frame: FrameType | None) -> None:
        self.reason = self.reason or "the job received SIGTERM"
        self.cancelled = True
        self._signalled.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def request(self, reason: str) -> None:
        """Stop after the current step (main process; from any thread), e.g. when the policy audit gives up on a
        replica. The decision reaches every rank at the next step end, like a stop request from the panel."""
        self.reason = self.reason or reason
        self._signalled.set()

    def requested(self) -> bool:
        if self._signalled.is_set():
            return True
        now = time.monotonic()
        if now - self._checked < self.check_every:
            return False
        self._checked = now
        try:
            body = self.store.get_bytes(layout.control_key(self.run_id, STOP))
        except StoreError:
            return False
        self.reason = StopRequest.model_validate_json(body).reason
        return True

    def on_step_end(self, _args: Any, state: Any, control: Any, **_kwargs: Any) -> None:
        reason = ranks.from_main(lambda: (self.reason or "stop requested") if self.requested() else None)
        if reason:
            self.reason = reason
            log.info("stopping after step %d: %s", state.global_step, self.reason)
            if self.telemetry is not None:
                self.telemetry.event("stop", f"stopping after step {state.global_step}: {self.reason}")
            control.should_save = True
            control.should_training_stop = True


class StepHint(Callback):
    """Tells the proxy the optimizer step before each sync, so every published version records its step.

    Runs before TRL's own callbacks (it is passed to the constructor), hence before the sync of the same step.
    """

    def __init__(self, post_step: Callable[[int], None]):
        self.post_step = post_step

    def on_train_begin(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        self.post_step(state.global_step)

    def on_step_end(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        self.post_step(state.global_step)
