"""The proxy's knobs: one dataclass, whose fields also make its command line (defaults follow the public recipe).

Each field carries its help text in its metadata; `add_arguments` turns every field into a `--flag` and
`from_arguments` reads them all back, so a knob added here is on the command line with no other edit.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, cast

from jobs.proxy.http_client import Origin
from jobs.proxy.router import LEAD_OVER


def knob(help: str, seconds: bool = False, **argument: Any) -> dict[str, Any]:
    """A config field's metadata: its command-line help; `seconds` marks a duration that must be positive;
    `argument` goes to argparse as it is (flag, choices, action, metavar)."""
    return {"help": help, "seconds": seconds, "argument": argument}


@dataclass
class ProxyConfig:
    port: int = field(default=8000, metadata=knob("listen port on 127.0.0.1 (0: any free port)"))
    upstreams: list[str] = field(
        default_factory=list, metadata=knob("a replica base URL", flag="--upstream", action="append", metavar="URL")
    )
    min_healthy: int = field(default=1, metadata=knob("/health is 200 with this many healthy replicas"))
    block_size: int = field(default=16, metadata=knob("tokens per prefix block (vLLM's prefix-cache block)"))
    imbalance: int = field(
        default=8, metadata=knob("max in-flight lead of an affinity pick over the mean (or least) load")
    )
    lead_over: str = field(
        default="mean",
        metadata=knob(
            "what the affinity pick's lead is measured over: the replicas' mean load, or the least loaded replica "
            "(the public recipe's rule; see jobs/proxy/router.py)",
            choices=LEAD_OVER,
        ),
    )
    group_allowance: int | None = field(
        default=None,
        metadata=knob(
            "in-flight requests for the same prompt not counted in that lead (default: num_generations - 1; "
            "0 is the public recipe's strict rule)"
        ),
    )
    max_tracked_blocks: int = field(default=200_000, metadata=knob("routing table LRU cap (~250 bytes a block)"))
    load_retry_interval: float = field(
        default=0.5, metadata=knob("re-send a load to a replica that cannot see the version yet", seconds=True)
    )
    load_deadline: float = field(
        default=300.0, metadata=knob("... until this long after the sync started", seconds=True)
    )
    connect_timeout: float = field(default=10.0, metadata=knob("connecting to a replica", seconds=True))
    read_timeout: float = field(
        default=900.0,
        metadata=knob(
            "without an upstream byte; a non-streamed generation is silent until done (TRL waits 600 s)",
            seconds=True,
        ),
    )
    health_interval: float = field(default=2.0, metadata=knob("between health checks", seconds=True))
    health_timeout: float = field(default=5.0, metadata=knob("for one health check", seconds=True))
    upstreams_poll: float = field(default=2.0, metadata=knob("between reads of control/upstreams.json", seconds=True))
    stats_period: float = field(default=10.0, metadata=knob("between telemetry snapshots", seconds=True))
    max_body: int = field(
        default=64 * 1024 * 1024, metadata=knob("largest request body accepted, in bytes (larger: 413)")
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if self.min_healthy < 1:
            raise ValueError("--min-healthy must be at least 1")
        if self.block_size < 1 or self.imbalance < 0 or self.max_tracked_blocks < 1 or self.max_body < 1:
            raise ValueError(
                "--block-size, --max-tracked-blocks and --max-body must be positive, --imbalance not negative"
            )
        if self.lead_over not in LEAD_OVER:
            raise ValueError(f"--lead-over must be one of {', '.join(LEAD_OVER)}")
        if self.group_allowance is not None and self.group_allowance < 0:
            raise ValueError("--group-allowance cannot be negative")
        for url in self.upstreams:
            Origin.parse(url)  # a clear message now rather than a traceback at start
        for knob_field in fields(self):
            if knob_field.metadata["seconds"] and getattr(self, knob_field.name) <= 0:
                raise ValueError(f"{_flag(knob_field.name)} must be a positive number of seconds")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per ProxyConfig field, with its default, type and help."""
    for knob_field in fields(ProxyConfig):
        argument = dict(knob_field.metadata["argument"])
        flag = argument.pop("flag", _flag(knob_field.name))
        default = [] if knob_field.default is MISSING else knob_field.default
        options: dict[str, Any] = {"dest": knob_field.name, "default": default}
        if argument.get("action") != "append":
            options["type"] = _value_type(cast(str, knob_field.type))  # a string: the module postpones annotations
        suffix = " (seconds)" if knob_field.metadata["seconds"] else ""
        parser.add_argument(flag, help=knob_field.metadata["help"] + suffix, **options, **argument)


def _value_type(annotation: str) -> type:
    """The type argparse converts a value to, from the field's annotation (`int | None` -> int)."""
    return {"int": int, "float": float, "str": str}[annotation.split(" | ")[0]]


def from_arguments(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(**{knob_field.name: getattr(args, knob_field.name) for knob_field in fields(ProxyConfig)})
