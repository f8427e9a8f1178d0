"""Where a run's jobs run: HF Jobs, or local processes on this machine, behind one interface (base.py)."""
