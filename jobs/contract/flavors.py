"""Hugging Face Jobs hardware: how many GPUs each flavor has and how much memory each of them holds.

How a run uses its hardware follows from this: the trainer's process count (one per GPU) and a replica's tensor
parallelism (one model over every GPU of its flavor). The Hub's own list (`HfApi.list_jobs_hardware`) is the
authority at launch and preflight checks every flavor against it; this table lets `python -m backend plan` and the
jobs themselves derive the same values with no network call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flavor:
    name: str
    gpus: int  # 0 for a CPU flavor
    gpu_memory_gb: float = 0.0  # per GPU


def _gpu_flavors(memory_gb: float, counts: dict[str, int]) -> list[Flavor]:
    return [Flavor(name, gpus, memory_gb) for name, gpus in counts.items()]


# The flavors HF Jobs documents (shared/reference/hf-jobs-and-buckets.md, 1.2), with each GPU's memory.
FLAVORS: dict[str, Flavor] = {
    flavor.name: flavor
    for flavor in (
        *[Flavor(name, 0) for name in ("cpu-basic", "cpu-upgrade", "cpu-performance", "cpu-xl")],
        *_gpu_flavors(16, {"t4-small": 1, "t4-medium": 1}),
        *_gpu_flavors(24, {"l4x1": 1, "l4x4": 4}),
        *_gpu_flavors(48, {"l40sx1": 1, "l40sx4": 4, "l40sx8": 8}),
        *_gpu_flavors(24, {"a10g-small": 1, "a10g-large": 1, "a10g-largex2": 2, "a10g-largex4": 4}),
        *_gpu_flavors(80, {"a100-large": 1, "a100x4": 4, "a100x8": 8}),
        *_gpu_flavors(141, {"h200": 1, "h200x2": 2, "h200x4": 4, "h200x8": 8}),
        *_gpu_flavors(96, {"rtx-pro-6000": 1, "rtx-pro-6000x2": 2, "rtx-pro-6000x4": 4, "rtx-pro-6000x8": 8}),
    )
}


def flavor(name: str) -> Flavor:
    """The flavor called `name`; ValueError naming the known ones if there is none."""
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(f"unknown flavor {name!r}; HF Jobs flavors are {', '.join(FLAVORS)}") from None
