"""Each row shape the row builders make (backend/ingestion/records.py) names exactly its table's columns.

`_bulk_insert` (backend/ingestion/ingest.py) builds its INSERT from a row's keys, so a column added to the model
but not to the row would silently stay at its default, and a key added to the row but not to the model would fail
only when a poller first inserts one.
"""

from __future__ import annotations

from typing import get_type_hints

import pytest
from sqlmodel import SQLModel

from backend.database.models import MetricPoint, RolloutSample, VersionScore
from backend.ingestion.records import EvalRow, MetricRow, SampleRow


@pytest.mark.parametrize(
    ("row", "table"),
    [(MetricRow, MetricPoint), (SampleRow, RolloutSample), (EvalRow, VersionScore)],
    ids=["metrics", "samples", "eval"],
)
def test_a_row_holds_every_column_of_its_table_but_the_id(row: type, table: type[SQLModel]) -> None:
    columns = set(table.model_fields) - {"id"}  # the id is the database's to give
    assert set(get_type_hints(row)) == columns
