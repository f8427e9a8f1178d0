"""KV-prefix affinity routing: send each generation to the replica that already holds its prompt's KV cache.

vLLM caches prompt KV in 16-token blocks, keyed by the chain of block contents and by the adapter name. The router
keeps the same picture: a prompt is cut into blocks (token ids: `block_size` tokens; text and chat messages: a
canonical UTF-8 encoding in chunks of 4 x `block_size` bytes, about as many tokens), and each block gets a hash chained
from the previous one and seeded by the model name, so a hash names a whole prefix under one adapter version.

The table maps a block hash to the replicas that were sent that prefix (a bitmask) and to its successor block (or
"several"). It is bounded by `max_blocks` with a two-generation approximation of LRU: blocks a request touches go to
the young generation; when it holds half the budget, the old generation is dropped and the young one becomes old. A
block therefore survives while it is used at least once per half-budget of new blocks. Plain dicts of int tuples
keep this cheap and invisible to the garbage collector (an OrderedDict of 200,000 entries made every full collection
take ~30 ms, a pause every in-flight request would feel). Forgetting an adapter version (after its unload) bumps that
version's generation, which is part of the seed: its old blocks can never match again and age out.

Decision for one request (only whole blocks count):

1. Walk the chain; a replica's *match* is the number of leading blocks it owns.
2. *Common* prefix: everything up to the last branching block — a block followed by two or more different blocks, or
   one this request leaves for a new block. A shared chat template is therefore never affinity.
3. *Specific* blocks = deepest match - common. With none, the request is **unmatched** and goes to the least loaded
   replica (round robin on ties). If every replica holds the prompt, it goes to the least loaded and counts as
   **affinity** (it is served from cache wherever it lands).
4. Otherwise the least loaded holder gets it (**affinity**) unless it is more than `imbalance` requests ahead of the
   replicas' mean load; then it is **spilled** to the least loaded one. In that comparison the holder's in-flight
   *siblings* (requests for the very same prompt, e.g. the other rollouts of a GRPO group, which TRL admits one
   after another) are not counted, up to `group_allowance`: a group's own burst is bounded by its size, and
   spilling its tail would recompute the whole prompt elsewhere.

Why the mean and not the least loaded replica (the public recipe's rule, `lead_over="least"`): the least of several
in-flight counts is their noisiest figure. When completions are short and requests turn over fast, one replica dips
for a moment many times a second, and every dip spilled a prompt that then had to be computed again elsewhere
(`bench/proxy_bench.py --only routing`, short workload: 0.04-0.13 % spilled and 0.46-0.87 % more prompt tokens
against the least loaded; 0.02-0.03 % and 0.22-0.33 % against the mean; docs/benchmarks/proxy.md, runs D and E).
A holder that is truly overloaded is ahead of the mean as well.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jobs.proxy.names import token_text

_FANOUT = -1  # successor marker: two or more different blocks followed this one (hash() never returns -1)
_CHAIN_CACHE = 4096  # prompts whose block hashes are remembered (a few MB)
LEAD_OVER = ("mean", "least")  # what a holder's load is compared with before it is spilled from (see rule 4)


class Routable(Protocol):
    slot: int  # a bit index unique to this admission of the replica
    inflight: int


@dataclass(slots=True)
class Decision:
    replica: Any
    kind: str  # "affinity", "spilled" or "unmatched"
    matched_blocks: int  # leading blocks the chosen replica already holds
    chains: list[tuple[int, ...]]
    namespace: tuple[str, int]
    tip: int | None  # identity of the prompt (its last whole block), for sibling counting


class Router:
    def __init__(
        self,
        block_size: int = 16,
        imbalance: int = 8,
        group_allowance: int = 7,
        max_blocks: int = 200_000,
        lead_over: str = "mean",
    ):
        if block_size < 1 or imbalance < 0 or group_allowance < 0 or max_blocks < 1:
            raise ValueError("block size and table size must be positive; imbalance and allowance not negative")
        if lead_over not in LEAD_OVER:
            raise ValueError(f"lead_over must be one of {', '.join(LEAD_OVER)}, not {lead_over!r}")
        self.block_size = block_size
        self.lead_over = lead_over
        self.chunk_bytes = 4 * block_size
        self.imbalance = imbalance
        self.group_allowance = group_allowance
        self.max_blocks = max_blocks
        # block hash -> (owners bitmask, successor hash | None | _FANOUT, namespace id), young and old generation.
        self._young: dict[int, tuple[int, int | None, int]] = {}
        self._old: dict[int, tuple[int, int | None, int]] = {}
        self._young_counts: dict[int, int] = {}  # namespace id -> blocks in that generation
        self._old_counts: dict[int, int] = {}
        self._generation: dict[str, int] = {}
        self._namespace_ids: dict[tuple[str, int], int] = {}
        self._siblings: dict[tuple[int, int], int] = {}
        self._recorded: dict[int, int] = {}  # prompt tip -> slots it was recorded for in this young generation
        self._chain_cache: OrderedDict[tuple[tuple[str, int], bytes], tuple[int, ...]] = OrderedDict()
        self._round_robin = 0
        self.routed = 0
        self.affinity = 0
        self.spilled = 0
        self.unmatched = 0
        self.saved_tokens = 0

    # -- hashing ---------------------------------------------------------------------------------------------------

    def _namespace(self, model: str) -> tuple[str, int]:
        return model, self._generation.get(model, 0)

    def _namespace_id(self, namespace: tuple[str, int]) -> int:
        number = self._namespace_ids.get(namespace)
        if number is None:
            number = self._namespace_ids[namespace] = len(self._namespace_ids)
        return number

    def chains(
        self, model: str, tokens: bytes | None, prompt: Any = None, messages: Any = None
    ) -> tuple[tuple[str, int], list[tuple[int, ...]]]:
        """The namespace of `model` and the block hash chain of each prompt of a request (several for a batch).

        `tokens` is a token-id prompt as canonical text (see names.generation_fields); otherwise `prompt` (text,
        a list of texts or of token-id lists) or chat `messages` are hashed.
        """
        namespace = self._namespace(model)
        seed = hash(namespace)
        if tokens is not None:
            return namespace, [self._token_chain(namespace, seed, tokens)]
        if isinstance(prompt, str):
            return namespace, [self._byte_chain(seed, prompt.encode())]
        if isinstance(prompt, list):
            chains = []
            for item in prompt:
                if isinstance(item, str):
                    chains.append(self._byte_chain(seed, item.encode()))
                elif isinstance(item, list) and all(type(token) is int for token in item):
                    chains.append(self._token_chain(namespace, seed, token_text(item)))
            return namespace, chains
        if isinstance(messages, list) and messages:
            canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
            return namespace, [self._byte_chain(seed, canonical.encode())]
        return namespace, []

    def _token_chain(self, namespace: tuple[str, int], seed: int, text: bytes) -> tuple[int, ...]:
        """Hashes of the whole `block_size`-token blocks of a token-id prompt, memoised: a GRPO group sends the
        same prompt `num_generations` times, and splitting and hashing it is the relay's largest cost."""
        key = (namespace, text)
        cache = self._chain_cache
        chain = cache.get(key)
        if chain is not None:
            cache.move_to_end(key)
            return chain
        tokens = text.split(b",") if text else []
        size = self.block_size
        hashes = []
        previous = seed
        for start in range(0, len(tokens) - size + 1, size):
            previous = hash((previous, *tokens[start : start + size]))
            hashes.append(previous)
        chain = cache[key] = tuple(hashes)
        if len(cache) > _CHAIN_CACHE:
            cache.popitem(last=False)
        return chain

    def _byte_chain(self, seed: int, data: bytes) -> tuple[int, ...]:
        size = self.chunk_bytes
        chain = []
        previous = seed
        for start in range(0, len(data) - size + 1, size):
            previous = hash((previous, data[start : start + size]))
            chain.append(previous)
        return tuple(chain)

    # -- deciding --------------------------------------------------------------------------------------------------

    def decide(
        self, namespace: tuple[str, int], chains: list[tuple[int, ...]], replicas: Sequence[Routable]
    ) -> Decision:
        """Pick one of `replicas` (at least one) for a request whose prompts hash to `chains`. Records nothing."""
        chain = chains[0] if chains else ()
        routable = 0
        for replica in replicas:
            routable |= 1 << replica.slot
        # Walk the chain: masks[i] = replicas owning every block up to i; common = blocks up to the last branch.
        young, old = self._young, self._old
        masks: list[int] = []
        common = 0
        mask = routable
        last = len(chain) - 1
        for index, block in enumerate(chain):
            entry = young.get(block) or old.get(block)
            if entry is None:
                break
            mask &= entry[0]
            if not mask:
                break
            masks.append(mask)
            successor = entry[1]
            if successor == _FANOUT or (successor is not None and index < last and successor != chain[index + 1]):
                common = index + 1
        depth = len(masks)
        tip = chain[-1] if chain else None
        least = min(replica.inflight for replica in replicas)
        if depth > common:
            holders_mask = masks[-1]
            if holders_mask == routable:
                return Decision(self._least_loaded(replicas, least), "affinity", depth, chains, namespace, tip)
            holder = min(
                (replica for replica in replicas if holders_mask >> replica.slot & 1), key=lambda r: r.inflight
            )
            load = holder.inflight
            if tip is not None:
                load -= min(self._siblings.get((tip, holder.slot), 0), self.group_allowance)
            if self.lead_over == "mean":
                baseline = sum(replica.inflight for replica in replicas) / len(replicas)
            else:
                baseline = least
            if load - baseline <= self.imbalance:
                return Decision(holder, "affinity", depth, chains, namespace, tip)
            chosen = self._least_loaded(replicas, least)
            return Decision(chosen, "spilled", _depth_of(masks, chosen.slot), chains, namespace, tip)
        chosen = self._least_loaded(replicas, least)
        return Decision(chosen, "unmatched", _depth_of(masks, chosen.slot), chains, namespace, tip)

    def _least_loaded(self, replicas: Sequence[Routable], least: int) -> Routable:
        ties = [replica for replica in replicas if replica.inflight == least]
        self._round_robin += 1
        return ties[self._round_robin % len(ties)]

    # -- recording -------------------------------------------------------------------------------------------------

    def record(self, decision: Decision, retry: bool = False) -> None:
        """The request was sent to `decision.replica`: it now holds every block of the request.

        A `retry` (the same request sent again after its first replica failed) is not counted again.
        """
        if not retry:
            self.routed += 1
            if decision.kind == "affinity":
                self.affinity += 1
            elif decision.kind == "spilled":
                self.spilled += 1
            else:
                self.unmatched += 1
            self.saved_tokens += decision.matched_blocks * self.block_size
        self._own(decision.chains, decision.replica.slot, decision.namespace)
        if decision.tip is not None:
            key = (decision.tip, decision.replica.slot)
            self._siblings[key] = self._siblings.get(key, 0) + 1

    def release(self, decision: Decision) -> None:
        """The request is finished: it no longer counts as an in-flight sibling."""
        if decision.tip is None:
            return
        key = (decision.tip, decision.replica.slot)
        count = self._siblings.get(key, 0) - 1
        if count > 0:
            self._siblings[key] = count
        else:
            self._siblings.pop(key, None)

    def _own(self, chains: list[tuple[int, ...]], slot: int, namespace: tuple[str, int]) -> None:
        bit = 1 << slot
        if self._recorded_before(chains, bit):
            return
        number = self._namespace_id(namespace)
        for chain in chains:
            young, old = self._young, self._old
            young_counts, old_counts = self._young_counts, self._old_counts
            last = len(chain) - 1
            for index, block in enumerate(chain):
                following = chain[index + 1] if index < last else None
                entry = young.get(block)
                if entry is None:
                    entry = old.pop(block, None)
                    if entry is None:
                        young[block] = (bit, following, number)
                        young_counts[number] = young_counts.get(number, 0) + 1
                        continue
                    old_counts[entry[2]] -= 1
                    young_counts[entry[2]] = young_counts.get(entry[2], 0) + 1
                owners, successor, owner_namespace = entry
                if following is not None and successor != following:
                    successor = following if successor is None else _FANOUT
                young[block] = (owners | bit, successor, owner_namespace)
            if len(young) >= self.max_blocks // 2:
                self._old, self._old_counts = young, young_counts
                self._young, self._young_counts = {}, {}
                self._recorded = {}

    def _recorded_before(self, chains: list[tuple[int, ...]], bit: int) -> bool:
        """Whether this one-prompt request was already recorded for this replica in the young generation, and note
        that it now is. The other rollouts of a GRPO group are exactly that, and recording them again changed
        nothing: every block of the prompt is young, owned by the replica, and knows its successor. Turning the
        generations over or clearing the table empties the note, also when it happens while this request is being
        recorded (the note is taken before)."""
        if len(chains) != 1 or not chains[0]:
            return False
        tip = chains[0][-1]
        slots = self._recorded.get(tip, 0)
        if slots & bit:
            return True
        self._recorded[tip] = slots | bit
        return False

    # -- forgetting ------------------------------------------------------------------------------------------------

    def forget_model(self, model: str) -> None:
        """Forget every block of one model name (an adapter version that was unloaded)."""
        self._generation[model] = self._generation.get(model, 0) + 1

    def clear(self) -> None:
        """Forget everything (the replicas' prefix caches were reset)."""
        self._young, self._old, self._young_counts, self._old_counts = {}, {}, {}, {}
        self._recorded = {}

    @property
    def tracked_blocks(self) -> int:
        """Blocks that can still match (stale blocks of forgotten versions excluded; they age out)."""
        current = {
            number for namespace, number in self._namespace_ids.items() if namespace == self._namespace(namespace[0])
        }
        generations = (self._young_counts, self._old_counts)
        return sum(count for counts in generations for number, count in counts.items() if number in current)

    def counters(self) -> dict[str, int]:
        return {
            "routed": self.routed,
            "affinity": self.affinity,
            "spilled": self.spilled,
            "unmatched": self.unmatched,
            "prefix_tokens_saved": self.saved_tokens,
            "tracked_blocks": self.tracked_blocks,
            "table_blocks": len(self._young) + len(self._old),
        }


def _depth_of(masks: list[int], slot: int) -> int:
    for depth in range(len(masks), 0, -1):
        if masks[depth - 1] >> slot & 1:
            return depth
    return 0
