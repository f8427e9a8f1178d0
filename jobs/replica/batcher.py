"""Continuous batching on transformers + PEFT: the generation core of the CPU engine.

One worker thread owns the model. Every iteration it

1. runs queued control operations (adapter loads and deletions), even while paused, because TRL loads the next
   adapter version between `/pause` and `/resume`;
2. admits waiting sequences into the running batch and prefills them together (left-padded, one forward). Sequences
   that share an adapter and an identical prompt (TRL's `num_generations` rollouts of one prompt) are prefilled once
   and their KV rows copied; `bench/replica_bench.py` measures what that saves;
3. samples one token for every running row, retires finished rows, and runs one batched decode step.

Rows of different adapters share a batch: PEFT's mixed-batch LoRA (`adapter_names`, one name per row, `__base__` for
the base model) applies each row's own adapter; a batch whose rows all name one adapter, the usual case, runs PEFT's
plain LoRA path with that adapter active instead (`RowAdapters`). The batch's KV cache is one left-padded
`DynamicCache`; joining rows are padded to the common length, finished rows are dropped, and columns that are padding
for every row are trimmed.

An unloaded adapter stops accepting requests at once, but its weights stay until the last sequence that named it
finishes: vLLM lets accepted requests complete, and TRL relies on that when it unloads version N-k-1 right after
loading N+1 (with `max_staleness` 0 the gap is one request wide).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from jobs.replica.sampling import RowView, SamplingParams, make_generator, sample

log = logging.getLogger(__name__)
BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class EngineBusy(Exception):
    """The engine refuses new work: it is paused in `abort` or `wait` mode, or shutting down."""


class AdapterError(Exception):
    """An adapter load failed; `status` is the HTTP status vLLM would answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class AdapterSlot:
    name: str
    path: str
    peft_name: str  # unique per load, so an in-place reload never collides with the weights it replaces
    users: int = 0  # sequences queued or running with this adapter
    retired: bool = False


@dataclass(eq=False)
class Sequence:
    """One completion choice. Mutated only by the worker thread; the event loop reads it after delivery."""

    prompt: list[int]
    params: SamplingParams
    adapter: AdapterSlot | None
    stop_ids: frozenset[int]
    on_update: Callable[[Sequence, int], None]  # called on the event loop with the number of tokens now available
    generator: torch.Generator = field(init=False)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 500  # the HTTP status the request is answered with when `error` is set
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.generator = make_generator(self.params.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: Counter[str | None] = field(default_factory=Counter)  # finish reason -> sequences


class RowAdapters:
    """Tells PEFT's LoRA layers which adapter each row of the next forward uses.

    A forward whose rows all name one adapter runs PEFT's plain LoRA path with that adapter made active (only when
    it changes); any other (several adapters, or the base model among them) runs PEFT's mixed-batch path with a name
    per row. The plain path skips the mixed one's per-adapter gathering of rows, and the layers are found and hooked
    once, not walked before every forward as `_enable_peft_forward_hooks` does: 1.39x the tokens per CPU-second of
    the demo model with one adapter, 1.19x with two (bench/replica_bench.py --only lora). The active adapter is set
    before every plain forward that needs another, so what PEFT last left active never matters (a deletion may
    change it too, but only away from the deleted adapter, whose name is never asked for again).
    """

    def __init__(self) -> None:
        self.layers: list[torch.nn.Module] = []
        self._mixed: list[str] | None = None  # per-row names while a mixed forward runs
        self._active: str | None = None  # the adapter every layer has active, when this object set it

    def track(self, peft_model: torch.nn.Module) -> None:
        """Hook the model's LoRA layers not hooked yet (an adapter may target modules the ones before did not), and
        forget which adapter is active: PEFT may have changed it."""
        from peft.tuners.lora import LoraLayer

        known = {id(layer) for layer in self.layers}
        for module in peft_model.modules():
            if isinstance(module, LoraLayer) and id(module) not in known:
                module.register_forward_pre_hook(self._name_rows, with_kwargs=True)
                self.layers.append(module)
        self._active = None

    def _name_rows(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._mixed is not None:
            kwargs["adapter_names"] = self._mixed
        return args, kwargs

    @contextlib.contextmanager
    def rows(self, names: list[str]) -> Iterator[None]:
        """Run the forward inside with row i using adapter `names[i]` (`BASE_ADAPTER`: none)."""
        single = names[0] if names[0] != BASE_ADAPTER and names.count(names[0]) == len(names) else None
        if single is not None and single != self._active:
            for layer in self.layers:
                layer.set_adapter(single, inference_mode=True)
            self._active = single
        self._mixed = None if single is not None else names
        try:
            yield
        finally:
            self._mixed = None


class BatchEngine:
    """Owns the model and its adapters; generates for many concurrent sequences in shared forward passes."""

    def __init__(
        self,
        model: torch.nn.Module,
        reload_base: Callable[[], torch.nn.Module],
        loop: asyncio.AbstractEventLoop,
        pad_id: int,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 8192,
        prefill_sharing: bool = True,
    ):
        self.model = model.eval()
        self._reload_base = reload_base
        self.peft: Any = None  # a peft.PeftModel once the first adapter is loaded
        self._row_adapters = RowAdapters()  # the PEFT model's LoRA layers, told each forward's adapters
        self.device = next(model.parameters()).device
        self.loop = loop
        self.pad_id = pad_id
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_sharing = prefill_sharing
        self.stats = EngineStats()

        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._ops: list[Callable[[], None]] = []
        self._adapters: dict[str, AdapterSlot] = {}
        self._reserved: set[str] = set()
        self._peft_names = (f"lora{n}" for n in itertools.count(1))
        self._paused = False
        self._refusing: str | None = None  # why new requests are refused (pause abort/wait, shutdown)
        self._in_step = False
        self._stopping = False

        # The running batch: rows, their pending next-token logits and their left-padded KV cache.
        self._rows: list[Sequence] = []
        self._logits: torch.Tensor | None = None
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, columns], 1 where a real token sits
        self._positions: torch.Tensor | None = None  # [rows], position id of each row's next token

        self._thread = threading.Thread(target=self._run, name="batch-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._check_cache_layout()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._refusing = "the engine is shutting down"
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            for seq in [*self._waiting, *self._rows]:
                seq.error, seq.error_status = "the engine shut down before this request finished; retry", 503
                self._deliver_now(seq)
            self._waiting.clear()
            self._rows = []

    def _check_cache_layout(self) -> None:
        """Refuse models whose cache is not plain per-layer KV (sliding windows, hybrids): batches cannot merge it."""
        ids = torch.tensor([[self.pad_id]], device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
        cache = out.cache
        if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise ValueError(
                f"the CPU engine batches only models with a full-attention KV cache; {type(self.model).__name__} "
                "uses sliding-window or hybrid layers. Serve it with vLLM (compute.engine = 'vllm')."
            )

    # ---- called from the event loop --------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def paused(self) -> bool:
        return self._paused

    def adapters(self) -> list[AdapterSlot]:
        with self._cond:
            return list(self._adapters.values())

    def adapter_names_in_use(self) -> tuple[set[str], set[str]]:
        """(names of adapters of running rows, names of adapters of waiting sequences), for vLLM's lora metric."""
        with self._cond:
            running = {s.adapter.name for s in self._rows if s.adapter}
            waiting = {s.adapter.name for s in self._waiting if s.adapter}
        return running, waiting

    def acquire(self, name: str | None, count: int) -> AdapterSlot | None:
        """The adapter a request names (None: the base model), pinned for `count` sequences. KeyError if unknown."""
        if name is None:
            return None
        with self._cond:
            slot = self._adapters[name]
            slot.users += count
            return slot

    def release(self, slot: AdapterSlot | None, count: int) -> None:
        """Unpin an adapter for `count` sequences that will not be submitted after all."""
        if slot is None:
            return
        with self._cond:
            self._release_locked(slot, count)

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue sequences whose adapter the caller acquired once per sequence. EngineBusy if refusing work."""
        with self._cond:
            if self._refusing:
                raise EngineBusy(self._refusing)
            self._waiting.extend(sequences)
            self._cond.notify_all()

    def cancel(self, sequences: list[Sequence]) -> None:
        """Drop sequences whose client went away: at once if they wait or the batch is idle, else after this step."""
        with self._cond:
            for seq in sequences:
                seq.cancelled = True
            for seq in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(seq)
                self._retire_sequence(seq)
            if not self._in_step:
                self._drop_cancelled_rows()
            self._cond.notify_all()

    async def load_adapter(self, name: str, path: str, inplace: bool) -> None:
        """Load a PEFT adapter directory under `name` (validated by the caller). AdapterError on failure."""
        with self._cond:
            if name in self._reserved or (name in self._adapters and not inplace):
                raise AdapterError(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True.",
                )
            self._reserved.add(name)
        try:
            peft_name = next(self._peft_names)
            await self._run_on_worker(lambda: self._load(path, peft_name))
            with self._cond:
                previous = self._adapters.get(name)
                self._adapters[name] = AdapterSlot(name=name, path=path, peft_name=peft_name)
                if previous is not None:
                    self._retire_locked(previous)
        finally:
            with self._cond:
                self._reserved.discard(name)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving `name`; its weights go once no accepted sequence uses them. False if it is not loaded."""
        with self._cond:
            slot = self._adapters.pop(name, None)
            if slot is None:
                return False
            self._retire_locked(slot)
            return True

    async def pause(self, mode: str) -> None:
        """Stop generating. `keep` holds new requests; `wait` drains accepted ones first; `abort` ends them now."""
        if mode == "wait":
            with self._cond:
                self._refusing = "the engine is paused; retry after /resume"
            await asyncio.to_thread(self._wait_until, lambda: not self._rows and not self._waiting)
        with self._cond:
            self._paused = True
            if mode != "keep":
                self._refusing = "the engine is paused; retry after /resume"
        await asyncio.to_thread(self._wait_until, lambda: not self._in_step)
        if mode == "abort":
            with self._cond:
                for seq in [*self._waiting, *self._rows]:
                    seq.finish_reason = seq.finish_reason or "abort"
                    self._retire_sequence(seq)
                self._waiting.clear()
                self._reset_batch()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._refusing = None
            self._cond.notify_all()

    # ---- worker thread ---------------------------------------------------------------------------------------

    def _wait_until(self, predicate: Callable[[], bool], timeout: float = 1800.0) -> None:
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise TimeoutError(f"the engine did not settle within {timeout:.0f}s")

    async def _run_on_worker(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the worker thread between two steps (it may change the model) and wait for it."""
        future = self.loop.create_future()

        def op() -> None:
            try:
                fn()
            except BaseException as error:  # handed to the awaiting request, whatever it is
                self.loop.call_soon_threadsafe(_set_exception, future, error)
            else:
                self.loop.call_soon_threadsafe(_set_result, future, None)

        with self._cond:
            if self._stopping:
                raise EngineBusy("the engine is shutting down")
            self._ops.append(op)
            self._cond.notify_all()
        await future

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping or self._ops or (not self._paused and (self._waiting or self._rows))
                )
                if self._stopping:
                    for op in self._ops:  # finish queued operations so that no request waits for them forever
                        op()
                    return
                ops, self._ops = self._ops, []
                admitted = [] if self._paused else self._admit()
                self._in_step = not self._paused
            for op in ops:
                op()
            if not self._in_step:
                continue
            try:
                with torch.inference_mode():
                    self._step(admitted)
            except Exception as error:  # a failed step fails its sequences, never the engine
                log.exception("generation step failed")
                with self._cond:
                    for seq in {id(seq): seq for seq in [*admitted, *self._rows]}.values():
                        if not seq.finished:
                            seq.error = f"generation failed: {error}"
                            self._retire_sequence(seq)
                    self._reset_batch()
            finally:
                with self._cond:
                    self._in_step = False
                    self._cond.notify_all()

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        longest = 0
        while self._waiting and len(self._rows) + len(admitted) < self.max_num_seqs:
            longest = max(longest, len(self._waiting[0].prompt))
            if admitted and longest * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            admitted.append(self._waiting.popleft())
        return admitted

    def _step(self, admitted: list[Sequence]) -> None:
        if admitted:
            self._prefill(admitted)
        with self._cond:
            self._drop_cancelled_rows()
        if not self._rows:
            return
        rows = self._rows
        sampled = sample(
            self._logits, [RowView(s.params, s.generator, s.prompt, s.output) for s in rows], [s.stop_ids for s in rows]
        )
        keep = []
        updates = []
        for i, seq in enumerate(rows):
            token = sampled.tokens[i]
            seq.output.append(token)
            seq.logprobs.append(sampled.logprobs[i])
            top = sampled.top[i]
            if top is not None:
                seq.top.append(top)
            if token in seq.stop_ids:
                seq.finish_reason = "stop"
            elif len(seq.output) >= seq.params.max_tokens:
                seq.finish_reason = "length"
            else:
                keep.append(i)
            updates.append((seq, len(seq.output)))
        self.stats.generation_tokens += len(rows)
        with self._cond:
            for seq in rows:
                if seq.finished:
                    self.stats.finished[seq.finish_reason] += 1
                    if seq.adapter is not None:
                        self._release_locked(seq.adapter, 1)
        self.loop.call_soon_threadsafe(_deliver_all, updates)
        if len(keep) < len(rows):
            self._keep(keep)
        if self._rows:
            tokens = torch.tensor([seq.output[-1] for seq in self._rows], device=self.device)
            self._decode(tokens)

    def _prefill(self, admitted: list[Sequence]) -> None:
        groups: dict[Any, list[int]] = {}
        for index, seq in enumerate(admitted):
            key = (seq.adapter.peft_name if seq.adapter else None, tuple(seq.prompt))
            groups.setdefault(key if self.prefill_sharing else index, []).append(index)
        leaders = [admitted[members[0]] for members in groups.values()]
        width = max(len(seq.prompt) for seq in leaders)
        ids = torch.full((len(leaders), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(leaders), width), dtype=torch.long)
        for row, seq in enumerate(leaders):
            ids[row, width - len(seq.prompt) :] = torch.tensor(seq.prompt)
            mask[row, width - len(seq.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(ids, mask, positions, leaders, cache=None)

        expand = torch.empty(len(admitted), dtype=torch.long)
        for row, members in enumerate(groups.values()):
            expand[members] = row
            self.stats.prefix_hits += len(admitted[members[0]].prompt) * (len(members) - 1)
        for seq in admitted:
            self.stats.prompt_tokens += len(seq.prompt)
            self.stats.prefix_queries += len(seq.prompt)
        expand = expand.to(self.device)
        new_layers = [(layer.keys[expand], layer.values[expand]) for layer in cache.layers]
        lengths = torch.tensor([len(seq.prompt) for seq in admitted], device=self.device)
        self._join(admitted, logits[expand], new_layers, mask[expand], lengths)

    def _decode(self, tokens: torch.Tensor) -> None:
        assert self._mask is not None and self._positions is not None  # called only with rows running
        ones = torch.ones((len(self._rows), 1), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        logits, self._cache = self._forward(
            tokens[:, None], self._mask, self._positions[:, None], self._rows, cache=self._cache
        )
        self._logits = logits
        self._positions = self._positions + 1

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        rows: list[Sequence],
        cache: DynamicCache | None,
    ) -> tuple[torch.Tensor, DynamicCache]:
        hooks: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.peft is not None:
            # Every row's adapter is named: the model's "active adapter" state must never matter. The model is called
            # directly: PeftModel.forward would refuse once every adapter has been deleted.
            hooks = self._row_adapters.rows([seq.adapter.peft_name if seq.adapter else BASE_ADAPTER for seq in rows])
        with hooks:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1].float(), out.cache

    def _join(
        self,
        rows: list[Sequence],
        logits: torch.Tensor,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Add prefilled rows to the running batch, left-padding whichever side is shorter."""
        if not self._rows:
            self._cache = DynamicCache(ddp_cache_data=layers)
            self._rows, self._logits, self._mask, self._positions = list(rows), logits, mask, positions
            return
        assert self._cache is not None and self._mask is not None  # a running batch has all its state
        assert self._logits is not None and self._positions is not None
        old, new = self._mask.shape[1], mask.shape[1]
        width = max(old, new)
        for layer, (keys, values) in zip(self._cache.layers, layers, strict=True):
            layer.keys = torch.cat([_pad_left(layer.keys, width - old, 2), _pad_left(keys, width - new, 2)])
            layer.values = torch.cat([_pad_left(layer.values, width - old, 2), _pad_left(values, width - new, 2)])
        self._mask = torch.cat([_pad_left(self._mask, width - old, 1), _pad_left(mask, width - new, 1)])
        self._rows.extend(rows)
        self._logits = torch.cat([self._logits, logits])
        self._positions = torch.cat([self._positions, positions])

    def _keep(self, keep: list[int]) -> None:
        """Drop every row not in `keep`, then trim columns that are padding for all remaining rows."""
        if not keep:
            self._reset_batch()
            return
        index = torch.tensor(keep, device=self.device)
        assert self._cache is not None and self._mask is not None  # `keep` names running rows
        assert self._logits is not None and self._positions is not None
        self._rows = [self._rows[i] for i in keep]
        self._logits, self._mask, self._positions = self._logits[index], self._mask[index], self._positions[index]
        start = int(self._mask.any(dim=0).nonzero()[0])
        for layer in self._cache.layers:
            layer.keys, layer.values = layer.keys[index, :, start:], layer.values[index, :, start:]
        self._mask = self._mask[:, start:]

    def _drop_cancelled_rows(self) -> None:
        """Remove rows whose client went away (caller holds the lock, and no step is running)."""
        if any(seq.cancelled for seq in self._rows):
            for seq in self._rows:
                if seq.cancelled:
                    self._retire_sequence(seq)
            with torch.inference_mode():
                self._keep([i for i, seq in enumerate(self._rows) if not seq.cancelled])

    def _reset_batch(self) -> None:
        self._rows, self._logits, self._cache, self._mask, self._positions = [], None, None, None, None

    def _load(self, path: str, peft_name: str) -> None:
        from peft import PeftModel

        try:
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=peft_name)
            else:
                self.peft.load_adapter(path, adapter_name=peft_name)
            self.peft.eval()
        except Exception as error:
            if self.peft is None:
                # The first load may have injected LoRA layers before failing; start again from clean weights.
                self.model = self._reload_base().eval()
            elif peft_name in self.peft.peft_config:
                self.peft.delete_adapter(peft_name)
            raise AdapterError(500, f"Loading the adapter in {path} failed: {error}") from error
        finally:
            if self.peft is not None:
                self._row_adapters.track(self.peft)

    # ---- bookkeeping (caller holds self._cond) ----------------------------------------------------------------

    def _retire_locked(self, slot: AdapterSlot) -> None:
        slot.retired = True
        if slot.users == 0:
            self._ops.append(lambda: self._delete(slot.peft_name))
            self._cond.notify_all()

    def _release_locked(self, slot: AdapterSlot, count: int) -> None:
        slot.users -= count
        if slot.retired and slot.users == 0:
            self._ops.append(lambda: self._delete(slot.peft_name))
            self._cond.notify_all()

    def _delete(self, peft_name: str) -> None:
        if self.peft is not None and peft_name in self.peft.peft_config:
            self.peft.delete_adapter(peft_name)

    def _retire_sequence(self, seq: Sequence) -> None:
        """A sequence leaves without finishing normally (cancelled, aborted, failed): unpin and answer it."""
        if seq.adapter is not None:
            self._release_locked(seq.adapter, 1)
        if not seq.cancelled:
            self._deliver_now(seq)

    def _deliver_now(self, seq: Sequence) -> None:
        self.loop.call_soon_threadsafe(_deliver_all, [(seq, len(seq.output))])


def _pad_left(tensor: torch.Tensor, amount: int, dim: int) -> torch.Tensor:
    if amount == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = amount
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _deliver_all(updates: list[tuple[Sequence, int]]) -> None:
    for seq, available in updates:
        seq.on_update(seq, available)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
