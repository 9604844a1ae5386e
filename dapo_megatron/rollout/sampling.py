"""Next-token sampling math of the embedded engine: temperature, top-k, top-p, and the log-prob to report.

For one row with logits ``z`` (shape ``[V]``), temperature ``T > 0``, truncation ``top_k`` / ``top_p`` and a uniform
``u`` in ``[0, 1)``:

1. ``logp = log_softmax(z / T)`` — the temperature-scaled distribution.
2. Truncation keeps a candidate set ``C``: the ``top_k`` most likely tokens (all when ``top_k == -1``), then, in
   decreasing probability, the shortest prefix whose mass reaches ``top_p`` (the most likely token always stays).
3. The token is drawn from ``exp(logp)`` restricted to ``C`` and renormalised, by inverse CDF: the first candidate
   whose cumulative mass exceeds ``u * mass(C)``.
4. The reported log-prob is ``logp[token]`` — under the temperature-scaled distribution BEFORE truncation. This is
   what the trainer recomputes with the policy (logits / T, full vocabulary), so the two are directly comparable.

``T == 0`` means greedy: ``token = argmax(z)``, truncation is irrelevant, and the reported log-prob is
``log_softmax(z)[token]`` (the untempered distribution, i.e. temperature 1).

Randomness comes from explicit uniforms, one per (sample, step), drawn by :func:`per_sample_uniforms` from
generators seeded per sample. A sample's tokens therefore depend only on the call seed, its prompt index, its
sample index and the model's logits — not on which other rows share its batch, how the call is chunked, or the
global torch RNG (which generation never touches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapo_megatron.rollout.engine import SamplingParams

_SEED_BOUND = 2**62


@dataclass(frozen=True)
class TokenSampler:
    """Picks the next token of every row of a ``[B, V]`` logits matrix (see the module docstring for the math)."""

    temperature: float
    top_k: int  # -1: off
    top_p: float  # 1.0: off

    @classmethod
    def from_params(cls, params: SamplingParams) -> "TokenSampler":
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(token_ids [B] int64, logprobs [B] float32)`` for ``logits [B, V]`` and ``uniforms [B]``
        (None when greedy)."""
        logits = logits.float()
        if self.is_greedy:
            token_ids = logits.argmax(dim=-1)
            logprobs = torch.log_softmax(logits, dim=-1)
            return token_ids, logprobs.gather(-1, token_ids[:, None]).squeeze(-1)

        logprobs = torch.log_softmax(logits / self.temperature, dim=-1)
        candidate_probs, candidate_ids = self._truncate(logprobs.exp())
        choice = inverse_cdf_choice(candidate_probs, uniforms)
        token_ids = choice if candidate_ids is None else candidate_ids.gather(-1, choice[:, None]).squeeze(-1)
        return token_ids, logprobs.gather(-1, token_ids[:, None]).squeeze(-1)

    def _truncate(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Candidate weights (zero outside the candidate set) and their token ids (None: the identity).

        Sorting is needed only for top-p; top-k alone uses ``topk``; no truncation keeps vocabulary order.
        """
        vocab_size = probs.shape[-1]
        top_k_active = 0 < self.top_k < vocab_size
        top_p_active = self.top_p < 1.0
        if not top_k_active and not top_p_active:
            return probs, None
        if top_k_active:
            weights, token_ids = probs.topk(self.top_k, dim=-1, sorted=True)
        else:
            weights, token_ids = probs.sort(dim=-1, descending=True)
        if top_p_active:
            # Keep a token while the mass strictly before it is below top_p: the shortest prefix reaching top_p.
            mass_before = weights.cumsum(dim=-1) - weights
            weights = weights.masked_fill(mass_before >= self.top_p, 0.0)
        return weights, token_ids


def inverse_cdf_choice(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first column whose running sum exceeds ``u * total`` (weights need not be normalised).

    Columns of weight zero are never chosen: the running sum does not exceed the threshold there.
    """
    cumulative = weights.cumsum(dim=-1)
    threshold = uniforms.to(cumulative.dtype)[:, None] * cumulative[:, -1:]
    choice = torch.searchsorted(cumulative, threshold, right=True).squeeze(-1)
    return choice.clamp_(max=weights.shape[-1] - 1)


def resolve_call_seed(seed: int | None) -> int:
    """The seed of one generate call: ``seed`` itself, or a fresh non-deterministic one (without touching the
    global RNG) when it is None."""
    if seed is not None:
        return int(seed)
    return torch.Generator().seed() % _SEED_BOUND


def per_sample_seeds(call_seed: int, num_prompts: int, n: int) -> torch.Tensor:
    """``[num_prompts, n]`` int64 seeds, one per sample, drawn from a generator seeded with ``call_seed``."""
    generator = torch.Generator().manual_seed(call_seed)
    return torch.randint(0, _SEED_BOUND, (num_prompts, n), generator=generator, dtype=torch.int64)


def per_sample_uniforms(sample_seeds: torch.Tensor, num_steps: int) -> torch.Tensor:
    """``[len(sample_seeds), num_steps]`` float32 uniforms in ``[0, 1)``: row ``r`` comes from a generator seeded
    with ``sample_seeds[r]``, so it does not depend on the other rows."""
    uniforms = torch.empty(len(sample_seeds), num_steps, dtype=torch.float32)
    generator = torch.Generator()
    for row, seed in enumerate(sample_seeds.tolist()):
        generator.manual_seed(seed)
        uniforms[row] = torch.rand(num_steps, generator=generator)
    return uniforms
