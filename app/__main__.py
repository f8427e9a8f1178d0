"""`python -m app` starts the control panel (see app.server)."""

from app.server import main

main()
