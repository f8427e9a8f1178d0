"""Tests of jobs/: what runs inside a job (contract, store, trainer, proxy, replica, evaluation, environments)."""
