"""The panel's SQLite database: tables, migrations, how it is opened, poll cursors, snapshots to the bucket."""
