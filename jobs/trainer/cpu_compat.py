"""Make TRL 1.16's AsyncGRPOTrainer run without CUDA.

TRL 1.16 only talks HTTP to its inference server, yet refuses to run on a CPU machine for three reasons (see
shared/reference/trl-async-grpo.md, section 6):

1. `AsyncRolloutWorker` requires the `vllm` package although it only uses aiohttp;
2. the MFU metric setup calls `torch.cuda.get_device_name`;
3. the training forward uses tree attention through a flash-attention kernel downloaded from the Hub at run time.

And accelerate 1.15 turns FSDP on only for GPU process groups: a gloo group of CPU processes stays plain data-parallel
whatever the FSDP plugin says. torch's FSDP2 (`fully_shard`) itself runs on gloo, so one more patch lets a CPU trainer
shard as a GPU trainer does: the 2-process CPU demo is how FSDP is rehearsed without a GPU.

Each patch replaces one private name; each checks first that the name exists, so a TRL version that moved it fails
at start with a message naming the version instead of silently running unpatched. Applied only when CUDA is absent.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import Any

import torch

SUPPORTED_TRL = "1.16.0"


class IncompatibleTRL(RuntimeError):
    pass


def _module(name: str) -> Any:
    """A module of TRL's async trainer, as Any: the patches below replace its private names."""
    return importlib.import_module(f"trl.experimental.async_grpo.{name}")


def _require(module: ModuleType, attribute: str) -> None:
    if not hasattr(module, attribute):
        import trl

        raise IncompatibleTRL(
            f"trl {trl.__version__} has no {module.__name__}.{attribute}; the CPU workaround targets trl "
            f"{SUPPORTED_TRL}. Install trl=={SUPPORTED_TRL} (pinned in requirements.txt)."
        )


def _always_available() -> bool:
    return True


def _no_peak_flops(_accelerator: object, _dtype: object) -> None:
    return None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    **_ignored: object,
) -> torch.Tensor:
    """`flash_attn_varlen_func` in plain PyTorch: attention over packed segments of (tokens, heads, dim) tensors.

    Segment i's queries are rows cu_seqlens_q[i]:cu_seqlens_q[i+1] and attend to keys cu_seqlens_k[i]:
    cu_seqlens_k[i+1]. Causality is bottom-right aligned (the last query sees every key), which is how tree packing
    lays a segment's path out: its ancestors first, then the segment itself.
    """
    if softcap:
        raise NotImplementedError("attention softcapping is not supported by the CPU attention fallback")
    output = torch.empty_like(q)
    query_heads, kv_heads = q.shape[1], k.shape[1]
    repeat = query_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    for index in range(len(cu_seqlens_q) - 1):
        q_start, q_end = int(cu_seqlens_q[index]), int(cu_seqlens_q[index + 1])
        k_start, k_end = int(cu_seqlens_k[index]), int(cu_seqlens_k[index + 1])
        if q_end == q_start:
            continue
        query = q[q_start:q_end].transpose(0, 1)  # (heads, q_len, dim)
        key = k[k_start:k_end].transpose(0, 1)
        value = v[k_start:k_end].transpose(0, 1)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=0)
            value = value.repeat_interleave(repeat, dim=0)
        q_len, k_len = q_end - q_start, k_end - k_start
        mask = None
        if causal or window_size[0] >= 0:
            query_positions = torch.arange(q_len).unsqueeze(1) + (k_len - q_len)
            key_positions = torch.arange(k_len).unsqueeze(0)
            mask = key_positions <= query_positions if causal else torch.ones(q_len, k_len, dtype=torch.bool)
            if window_size[0] >= 0:
                mask &= key_positions >= query_positions - window_size[0]
        attended = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
        output[q_start:q_end] = attended.transpose(0, 1)
    return output


class _TorchFlashAttention:
    flash_attn_varlen_func = staticmethod(varlen_attention)


def _torch_flash_attention() -> _TorchFlashAttention:
    return _TorchFlashAttention()


def _fsdp_on_cpu_process_groups() -> None:
    """Let accelerate's state honour an FSDP plugin in a CPU process group (see the module's docstring)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "fsdp_on_cpu", False):
        return

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # Every later `AcceleratorState()` (an optimizer's, at prepare) copies the process group's type over the
        # state again: re-apply FSDP each time, from the plugin the first one kept.
        plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    init.__dict__["fsdp_on_cpu"] = True  # the mark `getattr(original, "fsdp_on_cpu")` above looks for
    AcceleratorState.__init__ = init


def apply_cpu_patches(force: bool = False) -> bool:
    """Patch TRL for a CPU-only machine. Returns whether it patched (False when CUDA is available)."""
    if torch.cuda.is_available() and not force:
        return False
    worker, trainer, packing = _module("async_rollout_worker"), _module("async_grpo_trainer"), _module("packing")
    for module, name in (
        (worker, "is_vllm_available"),
        (trainer, "get_peak_flops_per_device"),
        (packing, "_flash_attn"),
    ):
        _require(module, name)
    worker.is_vllm_available = _always_available
    trainer.get_peak_flops_per_device = _no_peak_flops
    # `tree_attention` looks `_flash_attn` up at call time, so replacing the module attribute is enough.
    packing._flash_attn = _torch_flash_attention
    _fsdp_on_cpu_process_groups()
    return True
