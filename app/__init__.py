"""The control panel's web UI (Gradio): the server, the pages and their wiring, the public API; no SQL, no boto3."""
