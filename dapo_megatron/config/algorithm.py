"""``algorithm:``: the DAPO objective (clip-higher, token-level loss, overlong shaping, dynamic sampling) and the
corrections for samples the policy did not generate itself (an older version, another engine, other experts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dapo_megatron.config.errors import require, require_finite_numbers

# The registries' names (dapo_megatron/algorithm/objectives.py); a test holds them equal to the registries' keys, so
# a new objective is its registry entry, its name here, and its test.
PolicyLossName = Literal["dapo", "gspo", "gspo_token", "cispo"]
AdvantageEstimatorName = Literal["grpo"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# What each objective's paper prescribes for the settings it shares with the others, applied where the config leaves
# them null (its clip ranges have their own sections: algorithm.gspo, algorithm.cispo). The keys are the registry's
# (a test holds them equal).
OBJECTIVE_DEFAULTS: dict[str, dict[str, object]] = {
    "dapo": {"loss_agg": "token-mean"},  # DAPO eq. (10): 1 / Σ|o_i| over every token of the batch
    "gspo": {"loss_agg": "seq-mean-token-mean"},  # GSPO eq. (5): the mean over the group's responses
    "gspo_token": {"loss_agg": "seq-mean-token-mean"},  # GSPO eq. (13): 1/G Σ_i 1/|y_i| Σ_t
    "cispo": {"loss_agg": "token-mean"},  # MiniMax-M1's CISPO: 1 / Σ|o_i|, as DAPO
}
# The SGLang server flag without which a server returns no routing (moe_routing_replay: replay_rollout needs it).
SGLANG_ROUTING_FLAG = "--enable-return-routed-experts"


@dataclass
class GSPOConfig:
    """``algorithm.policy_loss: gspo / gspo_token``: the sequence-ratio clip range (dapo_megatron/algorithm/gspo.py).
    The paper's: a sequence ratio moves far less than a token ratio, so DAPO's 0.2 / 0.28 would hardly ever clip."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def validate(self) -> None:
        require(0 <= self.eps_low < 1, "algorithm.gspo.eps_low", f"must be in [0, 1), got {self.eps_low}")
        require(self.eps_high >= 0, "algorithm.gspo.eps_high", f"must be >= 0, got {self.eps_high}")


@dataclass
class CISPOConfig:
    """``algorithm.policy_loss: cispo``: the range of the stop-gradient IS weight (dapo_megatron/algorithm/cispo.py).
    eps_low_is = 1: no lower bound, as MiniMax-M1; eps_high_is = 3: a weight cap of 4 (the paper leaves it
    unpublished; 4 is Tinker's documented CISPO default)."""

    eps_low_is: float = 1.0
    eps_high_is: float = 3.0

    def validate(self) -> None:
        require(self.eps_low_is >= 0, "algorithm.cispo.eps_low_is",
                f"must be >= 0 (1 or more: no lower bound), got {self.eps_low_is}")
        require(self.eps_high_is >= 0, "algorithm.cispo.eps_high_is", f"must be >= 0, got {self.eps_high_is}")


@dataclass
class AlgorithmConfig:
    # The objective (dapo_megatron/algorithm/objectives.py): the policy loss and the advantage estimator.
    # eps_low / eps_high / clip_ratio_c below are dapo's; gspo and cispo have their own ranges.
    policy_loss: PolicyLossName = "dapo"
    advantage_estimator: AdvantageEstimatorName = "grpo"
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher; = eps_low gives GRPO's symmetric clip
    clip_ratio_c: float | None = 10.0  # dual clip for negative advantages
    # token-mean (DAPO), seq-mean-token-mean (GRPO, GSPO) or seq-mean-token-sum; null: the objective's own
    # (OBJECTIVE_DEFAULTS), so policy_loss: gspo alone trains the GSPO paper's objective.
    loss_agg: LossAggregation | None = None
    advantage_eps: float = 1e-6
    overlong_filtering: bool = True  # zero the loss mask of truncated samples
    overlong_penalty: bool = True  # soft overlong punishment
    overlong_buffer_len: int = 4096  # L_cache
    overlong_penalty_factor: float = 1.0
    dynamic_sampling: bool = True
    gen_batch_size: int = 1536  # prompts per generation round
    max_gen_rounds: int = 10  # at the cap the step trains on what it has (and logs it)
    # Groups collected beyond the batch (sync mode): "drop" them (the reference recipe), or "keep" them for the next
    # step, where they are off-policy by one version. "auto": keep when rollout_correction corrects them, else drop.
    surplus_policy: Literal["auto", "keep", "drop"] = "auto"
    use_math_verify: bool = False  # symbolic fallback after the DAPO exact match
    # Correction of the gap between the engine that sampled a token and the policy (different kernels, older
    # weights): token-level truncated IS, sequence-level masked IS, or both (dapo_megatron/algorithm/
    # rollout_correction.py). "none" trains tokens as sampled, except tokens of older weight versions in async mode,
    # which are masked out of the loss.
    rollout_correction: Literal["none", "token_tis", "seq_mis", "both"] = "none"
    tis_cap: float = 2.0  # token_tis: weight = min(π_old / π_rollout, tis_cap)
    mis_threshold: float = 2.0  # seq_mis: drop a response whose geometric-mean ratio leaves [1/τ, τ]
    # Mixture-of-experts policies: "replay_old" (R2) records which experts π_old's forward chose for every token and
    # makes each update's forward use the same ones (megatron's RouterReplay), so a routing flip between the two
    # passes cannot move the importance ratio; "replay_rollout" (R3) makes π_old's forward and every update's use the
    # experts the rollout engine chose (the embedded engine, or CUDA SGLang servers started with SGLANG_ROUTING_FLAG;
    # not with partial rollouts or tools), so a flip between engine and trainer cannot either
    # (dapo_megatron/policy/rollout_routing.py); "none" lets each forward
    # route by itself (dapo_megatron/policy/moe_routing.py). When to choose which: docs/models.md.
    moe_routing_replay: Literal["none", "replay_old", "replay_rollout"] = "none"

    @property
    def objective_defaults_applied(self) -> dict[str, object]:
        """The settings this config leaves null that ``policy_loss``'s own defaults fill ({key: value})."""
        own = OBJECTIVE_DEFAULTS.get(self.policy_loss, {})
        return {key: value for key, value in own.items() if getattr(self, key) is None}

    @property
    def aggregation(self) -> LossAggregation:
        """``loss_agg``, or the objective's own where it is null."""
        return self.loss_agg if self.loss_agg is not None else OBJECTIVE_DEFAULTS[self.policy_loss]["loss_agg"]

    @property
    def resolved_surplus_policy(self) -> Literal["keep", "drop"]:
        """``surplus_policy`` with "auto" resolved: surplus groups are kept only when the rollout correction will
        correct them as the stale samples they are."""
        if self.surplus_policy != "auto":
            return self.surplus_policy
        return "drop" if self.rollout_correction == "none" else "keep"

    def validate(self) -> None:
        """The checks that read this section alone; ``overlong_buffer_len`` against the response length and the
        MoE-only settings against the model are :meth:`DAPOConfig.validate`'s."""
        require_finite_numbers(self, "algorithm.")
        require(0 <= self.eps_low < 1, "algorithm.eps_low", f"must be in [0, 1), got {self.eps_low}")
        require(self.eps_high >= 0, "algorithm.eps_high", f"must be >= 0, got {self.eps_high}")
        require(self.clip_ratio_c is None or self.clip_ratio_c > 1, "algorithm.clip_ratio_c",
                f"must be > 1 (or null), got {self.clip_ratio_c}")
        self.gspo.validate()
        self.cispo.validate()
        require(self.gen_batch_size >= 1, "algorithm.gen_batch_size", "must be >= 1")
        require(self.max_gen_rounds >= 1, "algorithm.max_gen_rounds", "must be >= 1")
        require(self.tis_cap > 0, "algorithm.tis_cap", f"must be > 0, got {self.tis_cap}")
        require(self.mis_threshold > 1, "algorithm.mis_threshold", f"must be > 1, got {self.mis_threshold}")
