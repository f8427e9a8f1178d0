"""Sampling parameters and the batched sampler of the CPU engine, matching vLLM's semantics.

The log-probs returned are the processed log-probs TRL 1.16 consumes: the log-softmax of the logits after penalties
and temperature, *before* any top-k / top-p / min-p truncation. The trainer recomputes exactly that quantity
(log-softmax of its own logits / temperature), so its importance ratio stays at 1.0 when both sides hold the same
weights. vLLM's `processed_logprobs` are taken after the truncation (renormalised over the kept tokens), so the two
differ only for requests that truncate; TRL 1.16 does not model truncation either way (1.17 does), and with the
recipe's top_p = 1, top_k = 0 both are the same number.

Every row has its own `torch.Generator` and draws one uniform number per token (inverse-CDF sampling), so a seeded
request gives the same tokens whether it runs alone or inside a batch of strangers.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# vLLM treats temperatures below this as greedy decoding.
_GREEDY_EPSILON = 1e-5
# JSON has no -inf; vLLM reports impossible tokens with this value.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no log-probs; 0: only the sampled token's; k: also the top k
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def parse_sampling(body: dict[str, Any], max_logprobs: int) -> SamplingParams:
    """The sampling parameters of an OpenAI completions body; ValueError (vLLM's wording) on an invalid one."""

    def number(name: str, default: float) -> float:
        value = body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}.")
        return float(value)

    def optional_integer(name: str) -> int | None:
        value = body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}.")
        return value

    def integer(name: str, default: int) -> int:
        value = optional_integer(name)
        return default if value is None else value

    params = SamplingParams(
        max_tokens=integer("max_tokens", 16),
        temperature=number("temperature", 1.0),
        top_p=number("top_p", 1.0),
        top_k=integer("top_k", 0),
        min_p=number("min_p", 0.0),
        repetition_penalty=number("repetition_penalty", 1.0),
        presence_penalty=number("presence_penalty", 0.0),
        frequency_penalty=number("frequency_penalty", 0.0),
        min_tokens=integer("min_tokens", 0),
        stop_token_ids=tuple(_token_list(body.get("stop_token_ids"), "stop_token_ids")),
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=optional_integer("logprobs"),
        seed=optional_integer("seed"),
    )
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}.")
    if params.temperature < 0.0:
        raise ValueError(f"temperature must be non-negative, got {params.temperature}.")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}.")
    if params.top_k < -1:
        raise ValueError(f"top_k must be -1 (disable), or at least 1, got {params.top_k}.")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}.")
    if params.repetition_penalty <= 0.0:
        raise ValueError(f"repetition_penalty must be greater than zero, got {params.repetition_penalty}.")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(params, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}.")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens], got {params.min_tokens}.")
    if params.logprobs is not None and not 0 <= params.logprobs <= max_logprobs:
        raise ValueError(
            f"Requested sample logprobs of {params.logprobs}, which is greater than max allowed: {max_logprobs}"
        )
    if params.top_k == -1:
        params = _replace(params, top_k=0)
    return params


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, **changes})


def _token_list(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a list of integers.")
    return value


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one sequence: seeded as asked, or from the OS when the request names no seed."""
    generator = torch.Generator()
    generator.manual_seed((seed if seed is not None else secrets.randbits(63)) % (1 << 64))
    return generator


@dataclass
class RowView:
    """What the sampler needs to know about one row of the running batch."""

    params: SamplingParams
    generator: torch.Generator
    prompt: Sequence[int]
    output: Sequence[int]


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    # For rows that asked for top log-probs: (token id, log-prob) pairs, best first; None elsewhere.
    top: list[list[tuple[int, float]] | None]


def sample(logits: torch.Tensor, rows: Sequence[RowView], stop_ids: Sequence[frozenset[int]]) -> Sampled:
    """Draw one token per row of `logits` ([rows, vocab], float32) and report its processed log-prob.

    `stop_ids[i]` are the tokens that would end row i; they are masked while the row is shorter than `min_tokens`.
    """
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    for index, row in enumerate(rows):
        if row.params.min_tokens and len(row.output) < row.params.min_tokens and stop_ids[index]:
            logits[index, list(stop_ids[index])] = float("-inf")
        if row.params.penalised:
            _apply_penalties(logits[index], row, vocab)

    temperatures = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], device=logits.device)
    scaled = logits / temperatures[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    truncating = any(r.params.truncated for r in rows)
    probs = torch.softmax(_truncate(scaled, rows), dim=-1) if truncating else logprobs.exp()

    uniforms = torch.tensor([torch.rand((), generator=r.generator).item() for r in rows], device=logits.device)
    cdf = probs.cumsum(dim=-1)
    # Scaling by the total keeps rounding in the cumulative sum from ever selecting a zero-probability token.
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
    if greedy.any():
        tokens = torch.where(greedy, scaled.argmax(dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).clamp(min=LOGPROB_FLOOR)

    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    for index, row in enumerate(rows):
        if row.params.logprobs:
            values, ids = logprobs[index].topk(min(row.params.logprobs, vocab))
            top[index] = list(zip(ids.tolist(), values.clamp(min=LOGPROB_FLOOR).tolist(), strict=True))
    return Sampled(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)


def _apply_penalties(row_logits: torch.Tensor, row: RowView, vocab: int) -> None:
    """vLLM's penalties: repetition over prompt and output tokens, presence and frequency over output tokens."""
    params = row.params
    device = row_logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor([*row.prompt, *row.output], dtype=torch.long, device=device)] = True
        penalised = torch.where(
            row_logits > 0, row_logits / params.repetition_penalty, row_logits * params.repetition_penalty
        )
        row_logits.copy_(torch.where(seen, penalised, row_logits))
    if row.output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(row.output, device=device), minlength=vocab)[:vocab].float()
        row_logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()


def _truncate(scaled: torch.Tensor, rows: Sequence[RowView]) -> torch.Tensor:
    """Mask tokens outside min-p, top-k and top-p (in vLLM's order), per row; rows without truncation are unchanged."""
    device = scaled.device
    vocab = scaled.shape[-1]
    masked = scaled.clone()
    min_p = torch.tensor([r.params.min_p for r in rows], device=device)
    if (min_p > 0).any():
        probs = torch.softmax(masked, dim=-1)
        masked[probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values] = float("-inf")
    top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)
    if (top_k < vocab).any() or (top_p < 1.0).any():
        ordered, order = masked.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
        sorted_probs = torch.softmax(ordered, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside = (mass_before > top_p[:, None]) & (top_p < 1.0)[:, None]
        ordered = ordered.masked_fill(outside, float("-inf"))
        masked = torch.empty_like(masked).scatter_(-1, order, ordered)
    return masked
