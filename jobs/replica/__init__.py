"""The replica job: an inference engine behind an adapter sidecar, on one public port.

    python -m jobs.replica --spec <spec URI> --index <i> [--host 0.0.0.0] [--port 8000]
        [--store-endpoint URL] [--store-region R] [--engine auto|vllm|cpu]

Processes and ports:

    client (proxy) ──HTTP──> sidecar  0.0.0.0:<port>      (this process: jobs.replica.sidecar, aiohttp)
                                └──> engine 127.0.0.1:<internal port>   (a child process in its own process group)

* The **sidecar** owns the only exposed port (HF Jobs exposes one). It checks `Authorization: Bearer $REPLICA_TOKEN`
  when that is set, turns `store:runs/<run>/adapters/vNNNNNN/` loads into verified local folders, and relays
  everything else to the engine unchanged, streaming included. See `sidecar.py` for the exact answers.
* The **engine** is `vllm serve` on a GPU, or the CPU engine (`cpu_engine.py`, transformers + PEFT with continuous
  batching in `batcher.py`) elsewhere. Both speak the same HTTP contract, so the sidecar, the proxy and the contract
  tests (`tests/jobs/test_replica_contract.py`) cannot tell them apart. The command line of either is derived from the
  spec in `engine_command.py`.
* The CPU engine runs as a **child process**, like vLLM, rather than inside the sidecar: the sidecar's event loop
  never competes with generation for the GIL, a crashed or wedged engine cannot take the sidecar and its heartbeat
  down with it, one supervision path (start, health-wait, SIGTERM the group, SIGKILL after a grace period) serves
  both engines, and the engine can be started alone for tests and benchmarks. The cost is one loopback hop per
  request (see docs/benchmarks/replica.md) and a second Python process holding torch.
* The **heartbeat** (`heartbeat.py`) rewrites `runs/<run_id>/status/replica-<i>.json` every few seconds.

`__main__.py` ties them together and handles SIGTERM (see its docstring for the shutdown order and exit codes).
"""
