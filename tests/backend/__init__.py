"""Tests of backend/: the database, ingestion, launch preparation, launchers, the sandbox, credentials."""
