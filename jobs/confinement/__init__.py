"""What untrusted code runs under, wherever it runs: the panel's reward sandbox (backend/sandbox.py) and, in the
trainer, the tools of an agent's environment. `confine` applies namespaces, resource limits, Landlock (`landlock`) and
a seccomp filter to the calling process; the jobs import nothing from the panel, so the one copy lives here."""
