"""Which of the trainer job's processes this one is, and the few decisions its processes share.

On a multi-GPU flavor (and in the 2-process CPU demo) the trainer runs under `accelerate launch` (torchrun, DDP; see
`trainer_launcher` in backend/launchers/base.py): one process per GPU, each with a rank in the `RANK` and
`WORLD_SIZE` environment variables torchrun sets. TRL already splits the work: rank 0 alone talks to the inference
server (weight sync, rollout worker) and dispatches every micro-batch; the other ranks only forward, backward and
join the collectives. The job follows the same rule: everything that reaches outside the training loop — the proxy,
the replicas, every write to the store — is the main process's; the other ranks only read (the spec, the dataset).

A few things must still be decided once and shared, because ranks that disagree wait forever in a collective: the
local working folder (checkpoints, adapter versions and downloads go there), the checkpoint to resume from, and
whether to stop after a step. The main process decides; `from_main` hands its decision to every rank. With one
process nothing is shared and no process group is started, so a one-process trainer runs exactly as before.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TypeVar, cast

T = TypeVar("T")
# How long a rank may wait in a collective for the others (a rank that dies is caught sooner: torchrun ends the job).
COLLECTIVE_TIMEOUT = timedelta(hours=2)


def rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's global rank (0 when the job was not started through torchrun)."""
    return int(env.get("RANK", "0"))


def world_size(env: Mapping[str, str] = os.environ) -> int:
    """How many training processes the job has (1 when it was not started through torchrun)."""
    return int(env.get("WORLD_SIZE", "1"))


def is_main_process(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process speaks for the job: starts the proxy, writes to the store, stops the replicas."""
    return rank(env) == 0


def join_process_group(cuda: bool) -> None:
    """Start the job's process group (gloo on the CPU, NCCL on GPUs) before the first collective.

    With `COLLECTIVE_TIMEOUT`: NCCL's default of 10 minutes is shorter than what the other ranks may wait for the
    main one (the replicas' cold start, up to `--replica-wait`, then an audit inside a step), and TRL's own
    `ddp_timeout` does not apply to a group that already exists.

    Through accelerate's `PartialState`, as TRL's own `Accelerator` would: `cpu=True` on a machine without CUDA,
    since accelerate otherwise treats a torchrun worker there as a lone process. The trainer's `TrainingArguments`
    later find the group initialised and use it.
    """
    if world_size() == 1:
        return
    from accelerate import PartialState

    PartialState(cpu=not cuda, timeout=COLLECTIVE_TIMEOUT)


def leave_process_group() -> None:
    """Tear the job's process group down before the interpreter exits.

    Left to static destructors, gloo's threads may still be joinable when they run, and the process aborts ("terminate
    called without an active exception", exit -6) after training went well: the job would read as failed.
    """
    if world_size() == 1:
        return
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def from_main(decide: Callable[[], T]) -> T:
    """What `decide()` returns on the main process, handed to every rank; the other ranks never call it.

    A collective: every rank must call it at the same point. If `decide` raises, the main process fails and
    torchrun ends the other ranks.
    """
    if world_size() == 1:
        return decide()
    from accelerate.utils import broadcast_object_list

    return cast(T, broadcast_object_list([decide() if is_main_process() else None], from_process=0)[0])


def wait_for_all() -> None:
    """Return once every rank got here (e.g. every rank has written its part of a checkpoint)."""
    if world_size() == 1:
        return
    import torch.distributed

    torch.distributed.barrier()


def shared_workdir(given: str | None, run_id: str) -> str:
    """The local working folder of every rank: `given` (--output-dir / $GRPO_TRAINER_WORKDIR), else a new temporary
    folder the main process makes.

    Every rank must use the same one: TRL's main process writes each adapter version and checkpoint there, the other
    ranks write their parts of the same checkpoint (their RNG state) beside it, and every rank resumes from the
    checkpoint the main process downloads there.
    """
    return given or from_main(lambda: tempfile.mkdtemp(prefix=f"trainer-{run_id}-"))
