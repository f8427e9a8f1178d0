"""The poller and what it brings into SQLite: telemetry streams, versions, job stages, the run's status, alerts."""
