"""The panel's services without a UI: what app/ and the command line call; it drives jobs/ and keeps SQLite."""
