"""KV-prefix affinity routing: send each generation to the replica that already holds its prompt's KV cache.

vLLM caches prompt KV in 16-token blocks, keyed by the chain of block contents and by the adapter name. The router
keeps the same picture: a prompt is cut into blocks (token ids: `block_size` tokens; text and chat messages: a
canonical UTF-8 encoding in chunks of 4 x `block_size` bytes, about as many tokens), and each block gets a hash chained
from the previous one, so a hash names a whole prefix. The table files each block under the adapter version it was
sent with (the hash combined with a salt of the model name and its generation), as vLLM keys its cache by both.

The table maps a block hash to the replicas that were sent that prefix (a bitmask) and to its successor block (or
"several"). It is bounded by `max_blocks` with a two-generation approximation of LRU: blocks a request touches go to
the young generation; when it holds half the budget, the old generation is dropped and the young one becomes old. A
block therefore survives while it is used at least once per half-budget of new blocks. Plain dicts of int tuples
keep this cheap and invisible to the garbage collector (an OrderedDict of 200,000 entries made every full collection
take ~30 ms, a pause every in-flight request would feel). Forgetting an adapter version (after its unload) bumps that
version's generation, which is part of the salt: its old blocks can never match again and age out.

Decision for one request (only whole blocks count):

1. Walk the chain; a replica's *match* is the number of leading blocks it owns.
2. *Common* prefix: everything up to the last branching block inside the request — a block this request leaves for
   another block than the one that followed it before. A shared chat template is therefore never affinity. The
   request's own last block does not branch: it is followed by the answers to it and by the later turns of its
   conversations, and a prompt sent again (a GRPO group's next rollout) is the very prompt they continue.
3. *Specific* blocks = deepest match - common. With none, the request is **unmatched** and goes to the least loaded
   replica (round robin on ties), unless it continues a conversation held under an earlier adapter version (rule 5).
   If every replica holds the prompt, it goes to the least loaded and counts as **affinity** (it is served from cache
   wherever it lands).
4. Otherwise the least loaded holder gets it (**affinity**) unless it is more than `imbalance` requests ahead of the
   replicas' mean load; then it is **spilled** to the least loaded one. In that comparison the holder's in-flight
   *siblings* (requests for the very same prompt, e.g. the other rollouts of a GRPO group, which TRL admits one
   after another) are not counted, up to `group_allowance`: a group's own burst is bounded by its size, and
   spilling its tail would recompute the whole prompt elsewhere.
5. Conversations (agents with tools): TRL sends each turn as the whole conversation so far, the previous prompt +
   the model's answer + a tool result. The replica that answered holds the answer's blocks in its cache too (vLLM
   caches what it decodes), so once an answer comes back its first whole block past the prompt is recorded for that
   replica (`record_answer`), with the root of the conversation (the prompt of its first turn): the next turn
   matches it, past the point where the group's rollouts branched, and follows its own conversation instead of the
   group's prompt; and the turns of a group's episodes count as its siblings in rule 4, as its first turns do. After
   a weight sync the next turn is sent under the new adapter name, cached nowhere yet; an unmatched request is then
   matched under the few adapter versions recorded before, and **followed** to the replica that holds its
   conversation there (its later turns will hit there). All of this starts once a request has gone on past a whole
   prompt sent before (`conversations`): single-turn traffic reads no answer and pays nothing for it. Answers that
   came back before that moment are not recorded, so the turns continuing them are placed by rules 1-4.

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
from typing import Any, Protocol, TypedDict

from jobs.proxy.names import answer_token_ids, token_text

_FANOUT = -1  # successor marker: two or more different blocks followed this one (hash() never returns -1)
_SEED = 0  # the hash every chain starts from
_CHAIN_CACHE = 4096  # prompts whose block hashes are remembered ...
_CHAIN_CACHE_BYTES = 16 << 20  # ... and their text, at most (a long conversation is tens of kB)
_RECENT_NAMESPACES = 4  # adapter versions a conversation is looked for under when its own has nothing (rule 5)
LEAD_OVER = ("mean", "least")  # what a holder's load is compared with before it is spilled from (see rule 4)

Namespace = tuple[str, int]  # a model name and its generation (bumped when the name is forgotten)


class Routable(Protocol):
    slot: int  # a bit index unique to this admission of the replica
    inflight: int


@dataclass(slots=True)
class Decision:
    replica: Any
    kind: str  # "affinity", "spilled" or "unmatched"
    matched_blocks: int  # leading blocks the chosen replica already holds under this adapter version
    chains: list[tuple[int, ...]]
    namespace: Namespace
    salt: int  # the namespace's: a block is filed under its hash ^ salt
    tip: int | None  # the prompt's identity for sibling counting: its last whole block (salted), or the root of its
    # conversation (the tip of the prompt it continues from its first turn; rule 5)


class RouterCounters(TypedDict):
    """The router's part of a snapshot's `routing` (stats.py)."""

    routed: int
    affinity: int
    followed: int
    spilled: int
    unmatched: int
    prefix_tokens_saved: int
    tracked_blocks: int
    table_blocks: int


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
        # salted block hash -> (owners bitmask, successor hash | None | _FANOUT, namespace id), in two generations
        self._young: dict[int, tuple[int, int | None, int]] = {}
        self._old: dict[int, tuple[int, int | None, int]] = {}
        self._young_counts: dict[int, int] = {}  # namespace id -> blocks in that generation
        self._old_counts: dict[int, int] = {}
        self._generation: dict[str, int] = {}
        self._filing: dict[Namespace, tuple[int, int]] = {}  # namespace -> (its number, its salt)
        self._recent: list[Namespace] = []  # the last namespaces recorded, the latest last
        self._siblings: dict[tuple[int, int], int] = {}
        self._recorded: dict[int, int] = {}  # prompt tip -> slots it was recorded for in this young generation
        self._roots: dict[int, int] = {}  # an answer's first block (salted) -> its conversation's root, oldest first
        self.conversations = False  # whether a request has continued a prompt sent before (rule 5)
        # token-id prompt text -> (its chain, the tokens after its last whole block)
        self._chain_cache: OrderedDict[bytes, tuple[tuple[int, ...], list[bytes]]] = OrderedDict()
        self._chain_cache_bytes = 0
        self._round_robin = 0
        self.routed = 0
        self.affinity = 0
        self.spilled = 0
        self.unmatched = 0
        self.followed = 0
        self.saved_tokens = 0

    def adopt_block_size(self, block_size: int) -> bool:
        """Hash prompts in the engine's `block_size` from now on, if nothing has been filed yet (the replicas of a run
        run one engine on one kind of hardware, so the first one admitted decides); False if blocks are tracked."""
        if block_size == self.block_size:
            return True
        if self._young or self._old or self._chain_cache:
            return False
        self.block_size, self.chunk_bytes = block_size, 4 * block_size
        return True

    # -- hashing ---------------------------------------------------------------------------------------------------

    def _namespace(self, model: str) -> Namespace:
        return model, self._generation.get(model, 0)

    def _filed(self, namespace: Namespace) -> tuple[int, int]:
        """The namespace's number (which the table's counts are kept by) and its salt (which its blocks are filed
        under), given on first sight."""
        filing = self._filing.get(namespace)
        if filing is None:
            filing = self._filing[namespace] = (len(self._filing), hash(("router-namespace", namespace)))
        return filing

    def chains(
        self, model: str, tokens: bytes | None, prompt: object = None, messages: object = None
    ) -> tuple[Namespace, list[tuple[int, ...]]]:
        """The namespace of `model` and the block hash chain of each prompt of a request (several for a batch).

        `tokens` is a token-id prompt as canonical text (see names.generation_fields); otherwise `prompt` (text,
        a list of texts or of token-id lists) or chat `messages` are hashed.
        """
        namespace = self._namespace(model)
        if tokens is not None:
            return namespace, [self._token_chain(tokens)]
        if isinstance(prompt, str):
            return namespace, [self._byte_chain(prompt.encode())]
        if isinstance(prompt, list):
            chains = []
            for item in prompt:
                if isinstance(item, str):
                    chains.append(self._byte_chain(item.encode()))
                elif isinstance(item, list) and all(type(token) is int for token in item):
                    chains.append(self._token_chain(token_text(item)))
            return namespace, chains
        if isinstance(messages, list) and messages:
            canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
            return namespace, [self._byte_chain(canonical.encode())]
        return namespace, []

    def _token_chain(self, text: bytes) -> tuple[int, ...]:
        return self._token_blocks(text)[0]

    def _token_blocks(self, text: bytes) -> tuple[tuple[int, ...], list[bytes]]:
        """Hashes of the whole `block_size`-token blocks of a token-id prompt and the tokens after them, memoised: a
        GRPO group sends the same prompt `num_generations` times, and splitting and hashing it is the relay's largest
        cost; its answers continue the last partial block."""
        cache = self._chain_cache
        blocks = cache.get(text)
        if blocks is not None:
            cache.move_to_end(text)
            return blocks
        tokens = text.split(b",") if text else []
        size = self.block_size
        hashes = []
        previous = _SEED
        whole = len(tokens) - len(tokens) % size
        for start in range(0, whole, size):
            previous = hash((previous, *tokens[start : start + size]))
            hashes.append(previous)
        blocks = cache[text] = (tuple(hashes), tokens[whole:])
        self._chain_cache_bytes += len(text)
        while len(cache) > _CHAIN_CACHE or self._chain_cache_bytes > _CHAIN_CACHE_BYTES:
            forgotten, _ = cache.popitem(last=False)
            self._chain_cache_bytes -= len(forgotten)
        return blocks

    def _byte_chain(self, data: bytes) -> tuple[int, ...]:
        size = self.chunk_bytes
        chain = []
        previous = _SEED
        for start in range(0, len(data) - size + 1, size):
            previous = hash((previous, data[start : start + size]))
            chain.append(previous)
        return tuple(chain)

    # -- deciding --------------------------------------------------------------------------------------------------

    def decide(self, namespace: Namespace, chains: list[tuple[int, ...]], replicas: Sequence[Routable]) -> Decision:
        """Pick one of `replicas` (at least one) for a request whose prompts hash to `chains`. Records nothing but
        the first sign of conversations (rule 5)."""
        chain = chains[0] if chains else ()
        routable = 0
        for replica in replicas:
            routable |= 1 << replica.slot
        salt = self._filed(namespace)[1]
        masks, common = self._walk(chain, salt, routable)
        tip = chain[-1] ^ salt if chain else None
        least = min(replica.inflight for replica in replicas)
        if not self.conversations and 0 < len(masks) < len(chain):
            self.conversations = chain[len(masks) - 1] ^ salt in self._recorded  # it goes on past a whole prompt
        if len(masks) > common:
            tip = self._root(chain, len(masks), salt) or tip
            if masks[-1] == routable:
                chosen = self._least_loaded(replicas, least)
                return Decision(chosen, "affinity", len(masks), chains, namespace, salt, tip)
            holder = self._holder(masks, replicas, least, tip)
            if holder is not None:
                return Decision(holder, "affinity", len(masks), chains, namespace, salt, tip)
            chosen = self._least_loaded(replicas, least)
            return Decision(chosen, "spilled", _depth_of(masks, chosen.slot), chains, namespace, salt, tip)
        followed = (
            self._follow(chain, namespace, routable, replicas, least, tip) if self.conversations and chain else None
        )
        if followed is not None:
            holder, tip = followed
            kind = "followed" if holder is not None else "spilled"
            return Decision(holder or self._least_loaded(replicas, least), kind, 0, chains, namespace, salt, tip)
        chosen = self._least_loaded(replicas, least)
        return Decision(chosen, "unmatched", _depth_of(masks, chosen.slot), chains, namespace, salt, tip)

    def _walk(self, chain: tuple[int, ...], salt: int, routable: int) -> tuple[list[int], int]:
        """How far `chain` matches under one salt: masks[i] = the replicas owning every block up to i; and how many
        blocks are common (up to the last branch)."""
        young, old = self._young, self._old
        masks: list[int] = []
        common = 0
        mask = routable
        last = len(chain) - 1
        for index, block in enumerate(chain):
            key = block ^ salt
            entry = young.get(key) or old.get(key)
            if entry is None:
                break
            mask &= entry[0]
            if not mask:
                break
            masks.append(mask)
            successor = entry[1]
            if index < last and successor is not None and successor != chain[index + 1]:
                common = index + 1
        return masks, common

    def _follow(
        self,
        chain: tuple[int, ...],
        namespace: Namespace,
        routable: int,
        replicas: Sequence[Routable],
        least: int,
        tip: int | None,
    ) -> tuple[Routable | None, int | None] | None:
        """Rule 5 for a request unmatched under its own adapter version: the holder of its conversation under the
        latest earlier version that has it (None if that one leads by too much), and its tip; None if none has it."""
        for other in reversed(self._recent):
            if other != namespace:
                salt = self._filed(other)[1]
                masks, common = self._walk(chain, salt, routable)
                if len(masks) > common:
                    tip = self._root(chain, len(masks), salt) or tip
                    return self._holder(masks, replicas, least, tip), tip
        return None

    def _root(self, chain: tuple[int, ...], depth: int, salt: int) -> int | None:
        """The root of the conversation a request continues, if it does: the deepest block it matched is then the
        previous turn's answer, recorded with the root of the prompt it answered. The turns of a GRPO group's
        episodes then count as the group's siblings (rule 4), as its first turns do."""
        return self._roots.get(chain[depth - 1] ^ salt) if self._roots else None

    def _holder(self, masks: list[int], replicas: Sequence[Routable], least: int, tip: int | None) -> Routable | None:
        """The least loaded of the replicas holding the match, unless it leads the others by more than the imbalance
        allows (rule 4): then None, and the request is spilled."""
        holders = masks[-1]
        holder = min((replica for replica in replicas if holders >> replica.slot & 1), key=lambda r: r.inflight)
        load = holder.inflight
        if tip is not None:
            load -= min(self._siblings.get((tip, holder.slot), 0), self.group_allowance)
        baseline = least if self.lead_over == "least" else sum(r.inflight for r in replicas) / len(replicas)
        return holder if load - baseline <= self.imbalance else None

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
            elif decision.kind == "followed":
                self.followed += 1
            elif decision.kind == "spilled":
                self.spilled += 1
            else:
                self.unmatched += 1
            self.saved_tokens += decision.matched_blocks * self.block_size
        namespace = decision.namespace
        recent = self._recent
        if not recent or recent[-1] != namespace:
            if namespace in recent:
                recent.remove(namespace)
            recent.append(namespace)
            del recent[:-_RECENT_NAMESPACES]
        bit = 1 << decision.replica.slot
        if not self._recorded_before(decision.chains, bit, decision.salt):
            number = self._filed(namespace)[0]
            for chain in decision.chains:
                self._own(chain, bit, decision.salt, number)
        if decision.tip is not None:
            key = (decision.tip, decision.replica.slot)
            self._siblings[key] = self._siblings.get(key, 0) + 1

    def record_answer(self, decision: Decision, prompt: bytes, answer: bytes) -> None:
        """The replica answered a token-id `prompt` with `answer` (the reply's body): it now also holds the answer,
        of which the first whole block past the prompt's is recorded, with the root of its conversation (rule 5).
        Answers to a batch are not, nor any answer before the traffic has shown a conversation: a single-turn run
        pays nothing for them."""
        if not self.conversations or len(decision.chains) != 1:
            return
        chain, tail = self._token_blocks(prompt)
        needed = self.block_size - len(tail)
        answered = answer_token_ids(answer, needed)
        if answered is None or len(answered) < needed:
            return  # no whole block past the prompt's: the replicas that hold the prompt hold all of it
        block = hash((chain[-1] if chain else _SEED, *tail, *answered))
        self._own((block,), 1 << decision.replica.slot, decision.salt, self._filed(decision.namespace)[0])
        if decision.tip is not None:
            roots = self._roots
            roots[block ^ decision.salt] = decision.tip
            if len(roots) > self.max_blocks // 4:
                del roots[next(iter(roots))]

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

    def _own(self, chain: tuple[int, ...], bit: int, salt: int, number: int) -> None:
        """Record that the replica of `bit` holds every block of `chain`, filed under `salt` (namespace `number`)."""
        young, old = self._young, self._old
        young_counts, old_counts = self._young_counts, self._old_counts
        last = len(chain) - 1
        for index, block in enumerate(chain):
            following = chain[index + 1] if index < last else None
            key = block ^ salt
            entry = young.get(key)
            if entry is None:
                entry = old.pop(key, None)
                if entry is None:
                    young[key] = (bit, following, number)
                    young_counts[number] = young_counts.get(number, 0) + 1
                    continue
                old_counts[entry[2]] -= 1
                young_counts[entry[2]] = young_counts.get(entry[2], 0) + 1
            owners, successor, owner_namespace = entry
            if following is not None and successor != following:
                successor = following if successor is None else _FANOUT
            young[key] = (owners | bit, successor, owner_namespace)
        if len(young) >= self.max_blocks // 2:
            self._old, self._old_counts = young, young_counts
            self._young, self._young_counts = {}, {}
            self._recorded = {}

    def _recorded_before(self, chains: list[tuple[int, ...]], bit: int, salt: int) -> bool:
        """Whether this one-prompt request was already recorded for this replica in the young generation, and note
        that it now is. The other rollouts of a GRPO group are exactly that, and recording them again changed
        nothing: every block of the prompt is young, owned by the replica, and knows its successor. Turning the
        generations over or clearing the table empties the note, also when it happens while this request is being
        recorded (the note is taken before)."""
        if len(chains) != 1 or not chains[0]:
            return False
        tip = chains[0][-1] ^ salt
        slots = self._recorded.get(tip, 0)
        if slots & bit:
            return True
        self._recorded[tip] = slots | bit
        return False

    # -- forgetting ------------------------------------------------------------------------------------------------

    def forget_model(self, model: str) -> None:
        """Forget every block of one model name (an adapter version that was unloaded)."""
        namespace = self._namespace(model)
        if namespace in self._recent:
            self._recent.remove(namespace)
        self._generation[model] = self._generation.get(model, 0) + 1

    def clear(self) -> None:
        """Forget everything (the replicas' prefix caches were reset)."""
        self._young, self._old, self._young_counts, self._old_counts = {}, {}, {}, {}
        self._recorded, self._roots = {}, {}

    @property
    def tracked_blocks(self) -> int:
        """Blocks that can still match (stale blocks of forgotten versions excluded; they age out)."""
        current = {
            number for namespace, (number, _) in self._filing.items() if namespace == self._namespace(namespace[0])
        }
        generations = (self._young_counts, self._old_counts)
        return sum(count for counts in generations for number, count in counts.items() if number in current)

    def counters(self) -> RouterCounters:
        return {
            "routed": self.routed,
            "affinity": self.affinity,
            "followed": self.followed,
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
