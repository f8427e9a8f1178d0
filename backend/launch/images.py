"""What can be told about a job image before anything is submitted, without pulling it.

Every job starts with `python3 -c <bootstrap>` in its image, then installs the pinned packages the image lacks —
but not torch and not vLLM, which are too large to install per job and must come with the image. So:

- an image known to have no Python (distribution bases, servers, other languages) cannot run the bootstrap, and the
  official Python image has no torch: both refused;
- a replica on GPUs serves with vLLM: its image must be vLLM's OpenAI server in a version TRL 1.16 supports
  (0.22–0.31), or the replica would fall back to the CPU engine on a GPU machine;
- vLLM's and PyTorch's images bring python3 and torch; any other image may work: a warning points at the smoke test,
  which runs the bootstrap in it for cents.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jobs.contract import RunSpec
from jobs.contract.flavors import flavor

VLLM_IMAGE = "vllm/vllm-openai"
VLLM_SUPPORTED = ((0, 22), (0, 31))  # TRL 1.16's range, inclusive (minor versions)
# Images known to lack python3 (their official tags): the bootstrap cannot start in them.
NO_PYTHON = frozenset(
    {"alpine", "busybox", "ubuntu", "debian", "centos", "fedora", "nginx", "httpd", "node", "golang", "rust", "redis"}
)
# Image repositories known to bring python3 with a CUDA build of torch.
TORCH_IMAGES = (VLLM_IMAGE, "pytorch/pytorch", "nvcr.io/nvidia/pytorch", "huggingface/transformers-pytorch-gpu")


@dataclass
class ImageFindings:
    errors: dict[str, str] = field(default_factory=dict)  # spec field -> what is wrong and what to use
    warnings: list[str] = field(default_factory=list)


def check_images(spec: RunSpec) -> ImageFindings:
    """The problems the run's images would hit on HF Jobs (local jobs run this checkout's interpreter instead)."""
    findings = ImageFindings()
    if spec.compute.backend != "hf_jobs":
        return findings
    for role, image, gpus in (
        ("replica", spec.compute.replica_image, flavor(spec.compute.replica_flavor).gpus),
        ("trainer", spec.compute.trainer_image, flavor(spec.compute.trainer_flavor).gpus),
    ):
        problem = _problem(role, image, gpus)
        if problem is not None:
            findings.errors[f"compute.{role}_image"] = problem
        elif not _repository(image).startswith(TORCH_IMAGES):
            findings.warnings.append(
                f"{image}: cannot tell from here whether it has python3 and torch; run the smoke test, which starts "
                "the job bootstrap in it"
            )
    return findings


def _problem(role: str, image: str, gpus: int) -> str | None:
    repository = _repository(image).removeprefix("library/")
    if repository in NO_PYTHON:
        return f"{image} has no python3, which every job starts with; use {VLLM_IMAGE}:v0.27.1"
    if repository == "python":
        return f"{image} has no torch, which every job needs (it is not installed per job); use {VLLM_IMAGE}:v0.27.1"
    if role == "replica" and gpus:
        if repository != VLLM_IMAGE:
            return (
                f"replicas on GPUs serve with vLLM, which {image} does not bring; use {VLLM_IMAGE}:<v0.22 to v0.31> "
                "(e.g. v0.27.1)"
            )
        version = _vllm_version(image)
        if version is not None and not VLLM_SUPPORTED[0] <= version <= VLLM_SUPPORTED[1]:
            return f"TRL 1.16 works with vLLM 0.22 to 0.31, not {image.rsplit(':', 1)[-1]}; use {VLLM_IMAGE}:v0.27.1"
    return None


def _repository(image: str) -> str:
    """The image's repository without tag or digest (`vllm/vllm-openai:v0.27.1` -> `vllm/vllm-openai`)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name.removeprefix("docker.io/")


def _vllm_version(image: str) -> tuple[int, int] | None:
    match = re.search(r":v?(\d+)\.(\d+)", image)
    return (int(match.group(1)), int(match.group(2))) if match else None
