"""TRL's rollout worker, holding no more scored groups than the run's staleness window can take.

Between generating a group and handing its samples to the trainer's queue, TRL 1.16's rollout worker keeps up to 16
scored groups of its own (`score_queue_maxsize`, which `AsyncGRPOConfig` does not expose). Once the queue is full those
fill too, and generation runs on: in the demo (a window of 64 samples) they alone held two steps' worth, and a third
of the samples were too stale when the trainer reached them. `derived.rollout_limits` says how many the window leaves
room for; this worker passes it on to the child process that runs the loop.
"""

from __future__ import annotations

import importlib
from typing import Any

TRL_TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"


def limit_scored_groups(groups: int) -> None:
    """Make the trainer build its rollout worker with at most `groups` scored groups waiting for its queue.

    The trainer module names the worker class when it builds it, so the name is replaced there by a subclass
    (its isinstance checks still hold). Only the loop's keyword arguments reach the spawned child, so the subclass
    itself never needs to be imported there.
    """
    trainer = importlib.import_module(TRL_TRAINER_MODULE)
    base = getattr(trainer.AsyncRolloutWorker, "trl_worker", trainer.AsyncRolloutWorker)

    class BoundedRolloutWorker(base):  # type: ignore[misc, valid-type]  # TRL's class, typed loosely
        trl_worker = base

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**{"score_queue_maxsize": groups, **kwargs})

    setattr(trainer, "AsyncRolloutWorker", BoundedRolloutWorker)  # noqa: B010  # a module TRL owns
