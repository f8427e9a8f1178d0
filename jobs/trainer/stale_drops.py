"""TRL logs one INFO line per sample it drops as too stale: in a demo run, most of the trainer's log (a 40-step run
wrote some 3,000 of them), burying the lines a user reads the log for. The first drop is logged as TRL words it;
after it, drops are counted and each burst is summed up in one line once TRL logs something else. The Monitor shows
every dropped sample (they are recorded with the run's samples)."""

from __future__ import annotations

import logging

TRL_TRAINER_LOGGER = "trl.experimental.async_grpo.async_grpo_trainer"
DROP_PREFIX = "dropping stale sample"


class StaleDropSummary(logging.Filter):
    """A filter for TRL's trainer logger: lets the first drop through, counts the rest, and sums them up."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.unreported = 0
        self.log = logging.getLogger("jobs.trainer")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if DROP_PREFIX in message:
            self.seen += 1
            if self.seen == 1:
                record.msg, record.args = f"{message}; further drops are counted in one line per burst", None
                return True
            self.unreported += 1
            return False
        if self.unreported:
            self.log.info("%d more samples dropped as too stale (%d in all)", self.unreported, self.seen)
            self.unreported = 0
        return True


def summarise_stale_drops() -> StaleDropSummary:
    """Install the summary on TRL's trainer logger (the main process's, which pulls the samples)."""
    summary = StaleDropSummary()
    logging.getLogger(TRL_TRAINER_LOGGER).addFilter(summary)
    return summary
