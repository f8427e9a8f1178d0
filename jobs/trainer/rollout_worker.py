"""TRL's rollout worker as the job runs it: no more scored groups than the staleness window takes, and a stop that ends.

Between generating a group and handing its samples to the trainer's queue, TRL 1.16's rollout worker keeps up to 16
scored groups of its own (`score_queue_maxsize`, which `AsyncGRPOConfig` does not expose). Once the queue is full those
fill too, and generation runs on: in the demo (a window of 64 samples) they alone held two steps' worth, and a third
of the samples were too stale when the trainer reached them. `derived.rollout_limits` says how many the window leaves
room for; this worker passes it on to the child process that runs the loop.

The child runs the job's own loop (`jobs/trainer/episode_loop.py`): TRL's, keeping each reply's version and each
episode's token budget.

TRL's `stop` sets a multiprocessing event the child's watcher thread sleeps on, and `Event.set` waits for every
sleeper to wake. A child that is dying when the trainer stops (a reward failing too often ends it, and TRL's trainer
stops it right after) never wakes: the set, and with it the whole job, waited forever. This worker stops a failed child
without the event, and gives TRL's stop a deadline after which the child is killed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from jobs.trainer.episode_loop import EPISODE_TOKENS, EpisodeLoop

TRL_TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
STOP_DEADLINE_S = 30.0  # TRL's stop joins the child for 15 s, then 5 s more after terminating it
EXIT_WAIT_S = 5.0  # how long a failed child is given to finish exiting before it is killed

log = logging.getLogger(__name__)


def use_job_rollout_worker(groups: int, episode_tokens: int | None = None) -> None:
    """Make the trainer build its rollout worker with at most `groups` scored groups waiting for its queue, its
    episodes generating at most `episode_tokens` completion tokens each (None: no budget), and with a stop that
    always ends (`AlwaysStopping`).

    The trainer module names the worker class when it builds it, so the name is replaced there by a subclass
    (its isinstance checks still hold). Only the loop's keyword arguments reach the spawned child, so the subclass
    itself never needs to be imported there.
    """
    trainer = importlib.import_module(TRL_TRAINER_MODULE)
    base = getattr(trainer.AsyncRolloutWorker, "trl_worker", trainer.AsyncRolloutWorker)

    class BoundedRolloutWorker(AlwaysStopping, base):  # type: ignore[misc, valid-type]  # TRL's class, typed loosely
        trl_worker = base
        _loop_cls = EpisodeLoop  # built in the child, which imports it by its module

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**{"score_queue_maxsize": groups, EPISODE_TOKENS: episode_tokens, **kwargs})

    setattr(trainer, "AsyncRolloutWorker", BoundedRolloutWorker)  # noqa: B010  # a module TRL owns


class AlwaysStopping:
    """A `stop` for TRL's worker that returns whatever state its child is in, and leaves no child behind.

    Mixed in before TRL's class, whose attributes (`_process`, `_failed_event`, the two queues) it reads.
    """

    stop_deadline_s = STOP_DEADLINE_S
    _process: Any
    _failed_event: Any
    rollout_buffer: Any
    metrics_queue: Any

    def stop(self) -> None:
        process = self._process
        if process is None or process._popen is None:  # never started: TRL's stop has nothing to wait for
            super().stop()  # type: ignore[misc]  # TRL's method, after this class in the MRO
            return
        with _draining(self.rollout_buffer, self.metrics_queue):  # a child exits only once its queues are read
            if self._failed_event.is_set() or not process.is_alive():
                log.info("the rollout worker's child failed; waiting for it to exit")
                _end(process, EXIT_WAIT_S)
            else:
                trl_stop = super().stop  # type: ignore[misc]  # TRL's method, after this class in the MRO
                stopper = threading.Thread(target=trl_stop, name="rollout-worker-stop", daemon=True)
                stopper.start()
                stopper.join(self.stop_deadline_s)
                if stopper.is_alive():
                    log.warning(
                        "the rollout worker's child did not take TRL's stop within %.0f s; killing it",
                        self.stop_deadline_s,
                    )
                    _end(process, 0)
        self._process = None


def _end(process: Any, wait_s: float) -> None:
    """Give `process` `wait_s` seconds to exit, then kill it and reap it."""
    process.join(wait_s)
    if process.is_alive():
        process.kill()
        process.join(EXIT_WAIT_S)


@contextlib.contextmanager
def _draining(*sources: Any) -> Iterator[None]:
    """Read and discard what `sources` (multiprocessing queues) receive while the block runs.

    The child cannot exit while its queues hold unread samples and metrics, so TRL's stop usually waited its full
    15 s and then killed it; read meanwhile, the child exits in ~2 s.
    """
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            for source in sources:
                try:
                    source.get(timeout=0.05)
                except (queue.Empty, OSError, ValueError):
                    pass

    thread = threading.Thread(target=drain, name="rollout-worker-drain", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
