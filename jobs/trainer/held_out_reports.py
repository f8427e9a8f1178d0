"""Held-out scores in the run's Trackio and W&B reports (the panel reads them from the `eval` stream instead)."""

from __future__ import annotations

import threading
from typing import Any

from jobs.trainer.callback import Callback


class HeldOutReports(Callback):
    """Each evaluated version's held-out scores in the run's Trackio and W&B reports, as `eval/<score>` beside
    `eval/version` and `eval/version_step` (the version's own step; the report's step is the one at which the scores
    arrived, since both tools only log forward).

    The evaluator process hands each version's record over as it stores it (`add`); the next log line the trainer
    writes carries it as `eval_<score>`, which transformers' Trackio and W&B callbacks name `eval/<score>`. This
    callback goes first (`attach`) so that they see what it adds; the panel's metrics stream leaves `eval_` keys out
    (its `eval` stream has them). The last version is evaluated after training: `flush` reports what is left and
    closes the reports again.
    """

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(record)

    def take(self) -> dict[str, float]:
        """The pending records as log keys (a newer version's scores replace an older one's), and none pending."""
        with self._lock:
            records, self._pending = self._pending, []
        logs: dict[str, float] = {}
        for record in sorted(records, key=lambda r: int(r["version"])):
            logs |= {f"eval_{name}": float(score["mean"]) for name, score in record["scores"].items()}
            logs |= {"eval_version": float(record["version"]), "eval_version_step": float(record["step"])}
        return logs

    def attach(self, trainer: Any) -> None:
        trainer.callback_handler.callbacks.insert(0, self)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is not None:
            logs.update(self.take())

    def flush(self, trainer: Any) -> None:
        """After training: what the evaluator reported since the last log line, straight to the reporting callbacks
        (Trackio takes up its run again), which are then closed as at the end of training."""
        logs = self.take()
        if not logs:
            return
        from transformers.integrations import get_reporting_integration_callbacks

        kinds = tuple(get_reporting_integration_callbacks(trainer.args.report_to))
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, kinds):
                callback.on_log(trainer.args, trainer.state, trainer.control, model=trainer.model, logs=dict(logs))
                callback.on_train_end(trainer.args, trainer.state, trainer.control, model=trainer.model)
