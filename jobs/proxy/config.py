"""The proxy's knobs: one dataclass, filled from the command line (defaults follow the public recipe)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from jobs.proxy.http_client import Origin
from jobs.proxy.router import LEAD_OVER

_SECONDS = (
    "load_retry_interval",
    "load_deadline",
    "connect_timeout",
    "read_timeout",
    "health_interval",
    "health_timeout",
    "upstreams_poll",
    "stats_period",
)


@dataclass
class ProxyConfig:
    port: int = 8000
    upstreams: list[str] = field(default_factory=list)
    min_healthy: int = 1
    block_size: int = 16  # vLLM's prefix-cache block
    imbalance: int = 8  # max in-flight lead of an affinity pick over the mean (or least) load
    lead_over: str = "mean"  # "least": the public recipe's rule (see jobs/proxy/router.py)
    group_allowance: int | None = None  # in-flight siblings not counted in that lead; None: num_generations - 1
    max_tracked_blocks: int = 200_000  # routing table LRU cap (~250 bytes a block)
    load_retry_interval: float = 0.5  # re-send a load to a replica that cannot see the version yet
    load_deadline: float = 300.0  # ... until this many seconds after the sync started
    connect_timeout: float = 10.0
    read_timeout: float = 900.0  # inactivity; a non-streamed generation is silent until done (TRL waits 600 s)
    health_interval: float = 2.0
    health_timeout: float = 5.0
    upstreams_poll: float = 2.0  # how often control/upstreams.json is read
    stats_period: float = 10.0  # telemetry snapshot period
    max_body: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if self.min_healthy < 1:
            raise ValueError("--min-healthy must be at least 1")
        if self.block_size < 1 or self.imbalance < 0 or self.max_tracked_blocks < 1:
            raise ValueError("--block-size and --max-tracked-blocks must be positive, --imbalance not negative")
        if self.lead_over not in LEAD_OVER:
            raise ValueError(f"--lead-over must be one of {', '.join(LEAD_OVER)}")
        if self.group_allowance is not None and self.group_allowance < 0:
            raise ValueError("--group-allowance cannot be negative")
        for url in self.upstreams:
            Origin.parse(url)  # a clear message now rather than a traceback at start
        for name in _SECONDS:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ProxyConfig()
    add = parser.add_argument
    add("--port", type=int, default=defaults.port, help="listen port on 127.0.0.1 (0: any free port)")
    add("--upstream", dest="upstreams", action="append", default=[], metavar="URL", help="a replica base URL")
    add("--min-healthy", type=int, default=defaults.min_healthy, help="/health is 200 with this many healthy")
    add("--block-size", type=int, default=defaults.block_size, help="tokens per prefix block")
    add("--imbalance", type=int, default=defaults.imbalance, help="max in-flight lead for an affinity pick")
    add(
        "--lead-over",
        choices=LEAD_OVER,
        default=defaults.lead_over,
        help="what the affinity pick's lead is measured over: the replicas' mean load, or the least loaded replica "
        "(the public recipe's rule)",
    )
    add(
        "--group-allowance",
        type=int,
        default=None,
        help="in-flight requests for the same prompt not counted in that lead (default: num_generations - 1; "
        "0 is the public recipe's strict rule)",
    )
    add("--max-tracked-blocks", type=int, default=defaults.max_tracked_blocks, help="routing table LRU cap")
    add("--load-retry-interval", type=float, default=defaults.load_retry_interval, help="seconds")
    add("--load-deadline", type=float, default=defaults.load_deadline, help="seconds for an adapter broadcast")
    add("--connect-timeout", type=float, default=defaults.connect_timeout, help="seconds")
    add("--read-timeout", type=float, default=defaults.read_timeout, help="seconds without an upstream byte")
    add("--health-interval", type=float, default=defaults.health_interval, help="seconds between health checks")
    add("--health-timeout", type=float, default=defaults.health_timeout, help="seconds")
    add("--upstreams-poll", type=float, default=defaults.upstreams_poll, help="seconds between upstream list reads")
    add("--stats-period", type=float, default=defaults.stats_period, help="seconds between telemetry snapshots")


def from_arguments(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        port=args.port,
        upstreams=list(args.upstreams),
        min_healthy=args.min_healthy,
        block_size=args.block_size,
        imbalance=args.imbalance,
        lead_over=args.lead_over,
        group_allowance=args.group_allowance,
        max_tracked_blocks=args.max_tracked_blocks,
        load_retry_interval=args.load_retry_interval,
        load_deadline=args.load_deadline,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        upstreams_poll=args.upstreams_poll,
        stats_period=args.stats_period,
    )
