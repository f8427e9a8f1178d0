"""The reward sandbox: the panel's side (client.py) and the runner that confines itself in the child (runner.py)."""
