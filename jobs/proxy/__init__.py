"""The proxy between TRL's AsyncGRPOTrainer and the inference replicas (see app.py for the endpoints).

Start it as a child process of the trainer: `python -m jobs.proxy --spec <spec URI> --port 8000`, with the replicas'
bearer token in UPSTREAM_TOKEN and the store credentials in the environment, then wait for `GET /health` to answer
200. In-process: `proxy = Proxy(ProxyConfig(...), spec, store, token); await proxy.start(); ...; await proxy.stop()`.
"""

from jobs.proxy.app import Proxy
from jobs.proxy.config import ProxyConfig

__all__ = ["Proxy", "ProxyConfig"]
