"""The objective registry (algorithm.policy_loss / advantage_estimator) and GSPO, GSPO-token and CISPO against
reference implementations written here from the papers' formulas, in float64: values and autograd gradients, for
random inputs with the clips active and not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loss_settings import policy_loss

from dapo_megatron.algorithm import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, build_advantage_estimator, build_policy_loss
from dapo_megatron.config import AlgorithmConfig, ConfigError, config_to_dict, load_config, save_config
from dapo_megatron.run.config_record import check_resume_config

torch.set_num_threads(1)
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
GSPO_EPS = dict(eps_low=3e-4, eps_high=4e-4)
CISPO_EPS = dict(eps_low_is=1.0, eps_high_is=3.0)


# ------------------------------------------------------------------------------------- references (the papers)

def reference_gspo(logprobs, old, advantages, mask, eps_low, eps_high, agg, token_level):
    """Response by response: s_i = exp(mean_t(log π − log π_old)), −min(s·A, clip(s)·A) per token (the token form:
    s_{i,t} = sg[s_i]·π_t / sg[π_t]); aggregated per ``agg`` over the responses with loss tokens."""
    per_sequence = []
    for i in range(logprobs.shape[0]):
        keep = mask[i].bool()
        if not keep.any():
            continue
        lp, lp_old = logprobs[i][keep], old[i][keep]
        adv = advantages[i][keep] if advantages.dim() == 2 else advantages[i].expand(lp.shape)
        s = torch.exp((lp - lp_old).mean())
        if token_level:
            s = s.detach() * torch.exp(lp - lp.detach())
        else:
            s = s.expand(lp.shape)
        losses = -torch.minimum(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv)
        per_sequence.append(losses)
    return _reference_aggregate(per_sequence, agg)


def reference_cispo(logprobs, old, advantages, mask, eps_low_is, eps_high_is, agg):
    """−sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π per token, aggregated per ``agg``."""
    per_sequence = []
    for i in range(logprobs.shape[0]):
        keep = mask[i].bool()
        if not keep.any():
            continue
        lp, lp_old = logprobs[i][keep], old[i][keep]
        adv = advantages[i][keep] if advantages.dim() == 2 else advantages[i].expand(lp.shape)
        weight = torch.clamp(torch.exp(lp - lp_old), max(1 - eps_low_is, 0.0), 1 + eps_high_is).detach()
        per_sequence.append(-weight * adv * lp)
    return _reference_aggregate(per_sequence, agg)


def _reference_aggregate(per_sequence, agg):
    if agg == "token-mean":
        return torch.cat(per_sequence).sum() / sum(len(x) for x in per_sequence)
    if agg == "seq-mean-token-mean":
        return torch.stack([x.mean() for x in per_sequence]).mean()
    return torch.stack([x.sum() for x in per_sequence]).mean()


def random_batch(seed: int, shift: float, per_token_advantages: bool = False):
    """log-probs = old + noise + ``shift`` (per response), a ragged mask with one fully masked response."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 9, generator=generator, dtype=torch.float64) * 3 - 0.1
    noise = 0.02 * torch.randn(6, 9, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([9, 4, 1, 7, 0, 5])
    mask = (torch.arange(9)[None] < lengths[:, None]).to(torch.float64)
    noise = noise - (noise * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # mean 0
    shifts = shift * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 0.5], dtype=torch.float64)[:, None]
    logprobs = old + noise + shifts
    logprobs = torch.where(mask.bool(), logprobs, torch.nan)  # padding must not leak
    advantages = torch.tensor([1.0, 1.0, -0.5, -1.0, 2.0, -2.0], dtype=torch.float64)
    if per_token_advantages:
        advantages = advantages[:, None] * (0.5 + torch.rand(6, 9, generator=generator, dtype=torch.float64))
    return logprobs, old, advantages, mask


def value_and_grad(fn, logprobs, *args, **kwargs):
    logprobs = logprobs.clone().requires_grad_(True)
    loss = fn(logprobs, *args, **kwargs)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), torch.nan_to_num(grad, nan=0.0)


def close(got, want):
    """float32 arithmetic in the project's loss against the float64 reference."""
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-7)


def project_loss(name: str, **settings):
    """The registry's loss for ``algorithm.policy_loss = name`` with the given schema settings."""
    return build_policy_loss(AlgorithmConfig(policy_loss=name, **settings))


# ------------------------------------------------------------------------------------------------- GSPO

# shift 1e-4 keeps every s_i inside [1 − 3e-4, 1 + 4e-4]; 0.01 puts every one outside (both sides, both signs of A)
@pytest.mark.parametrize("shift,clipped", [(1e-4, False), (0.01, True)])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name,token_level", [("gspo", False), ("gspo_token", True)])
def test_gspo_matches_the_reference(name, token_level, agg, shift, clipped):
    logprobs, old, advantages, mask = random_batch(0, shift)
    got, got_grad = value_and_grad(project_loss(name, loss_agg=agg), logprobs, old, advantages, mask,
                                   num_tokens=None, num_sequences=None)
    want, want_grad = value_and_grad(
        lambda lp: reference_gspo(lp, old, advantages, mask, **GSPO_EPS, agg=agg, token_level=token_level), logprobs)
    close(got, want)
    close(got_grad, want_grad)
    # where a response's clip is active its every token's gradient is 0: here only responses with A·shift > 0 clip
    pushed_out = (advantages * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 0.5], dtype=torch.float64)) > 0
    live = mask.bool().any(-1)
    assert bool((got_grad[pushed_out & live] == 0).all()) is clipped
    assert bool((got_grad[~pushed_out & live].abs().sum(-1) > 0).all())  # the other side of the clip still learns


def test_gspo_unclipped_gradient_is_the_sequence_mean():
    """∇ℓ_i = −A_i·s_i·(1/|o_i|)·∇Σ_t log π: every token of a response gets −A·s/|o_i| (seq-mean over S = 5)."""
    logprobs, old, advantages, mask = random_batch(1, 1e-4)
    _, grad = value_and_grad(project_loss("gspo", loss_agg="seq-mean-token-mean"), logprobs, old, advantages, mask,
                             num_tokens=None, num_sequences=None)
    lengths = mask.sum(-1)
    s = torch.exp(((torch.nan_to_num(logprobs) - old) * mask).sum(-1) / lengths.clamp(min=1))
    expected = (-advantages * s / lengths.clamp(min=1) / 5)[:, None] * mask
    close(grad, expected)


def test_gspo_and_gspo_token_differ_only_with_per_token_advantages():
    logprobs, old, advantages, mask = random_batch(2, 1e-4)
    sequence, token = project_loss("gspo"), project_loss("gspo_token")
    args = (old, advantages, mask)
    counts = dict(num_tokens=None, num_sequences=None)
    torch.testing.assert_close(value_and_grad(sequence, logprobs, *args, **counts),
                               value_and_grad(token, logprobs, *args, **counts))
    weighted = random_batch(2, 1e-4, per_token_advantages=True)[2]  # token_tis: advantages w_t·A
    for name, token_level in (("gspo", False), ("gspo_token", True)):
        got = value_and_grad(project_loss(name), logprobs, old, weighted, mask, **counts)
        want = value_and_grad(lambda lp: reference_gspo(lp, old, weighted, mask, **GSPO_EPS,
                                                        agg="seq-mean-token-mean", token_level=token_level), logprobs)
        close(got[1], want[1])
    assert not torch.allclose(value_and_grad(sequence, logprobs, old, weighted, mask, **counts)[1],
                              value_and_grad(token, logprobs, old, weighted, mask, **counts)[1])


def test_gspo_metrics_count_tokens_of_clipped_responses():
    logprobs, old, advantages, mask = random_batch(3, 0.01)
    _, metrics = project_loss("gspo")(logprobs, old, advantages, mask, num_tokens=None, num_sequences=None)
    lengths = mask.sum(-1)
    # A·shift > 0 puts s beyond the range on A's side: response 0 clips high (A > 0), 3 low (A < 0); 4 has no loss
    # tokens; 1, 2 and 5 moved against their advantage and do not clip
    assert metrics["clipfrac_high"] == pytest.approx(float(lengths[0] / lengths.sum()))
    assert metrics["clipfrac_low"] == pytest.approx(float(lengths[3] / lengths.sum()))
    assert metrics["clipfrac_dual"] == 0.0 and metrics["num_active_sequences"] == 5


# ------------------------------------------------------------------------------------------------- CISPO

@pytest.mark.parametrize("shift", [0.01, 2.0])  # 2.0: every ratio of a shifted-up response beyond 1 + 3
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("per_token", [False, True])
def test_cispo_matches_the_reference(agg, shift, per_token):
    logprobs, old, advantages, mask = random_batch(4, shift, per_token_advantages=per_token)
    got, got_grad = value_and_grad(project_loss("cispo", loss_agg=agg), logprobs, old, advantages, mask,
                                   num_tokens=None, num_sequences=None)
    want, want_grad = value_and_grad(lambda lp: reference_cispo(lp, old, advantages, mask, **CISPO_EPS, agg=agg),
                                     logprobs)
    close(got, want)
    close(got_grad, want_grad)


def test_cispo_keeps_the_gradient_dapo_drops():
    """One token with A > 0 whose ratio rose to 6: DAPO's clip zeroes its gradient; CISPO's is −(1 + 3)·A."""
    logprobs = torch.log(torch.tensor([[6.0]], dtype=torch.float64)) - 3.0
    old, advantage, mask = torch.full((1, 1), -3.0, dtype=torch.float64), torch.tensor([1.5]), torch.ones(1, 1)
    counts = dict(num_tokens=None, num_sequences=None)
    _, dapo_grad = value_and_grad(project_loss("dapo"), logprobs, old, advantage, mask, **counts)
    cispo_loss, cispo_grad = value_and_grad(project_loss("cispo"), logprobs, old, advantage, mask, **counts)
    assert dapo_grad.item() == 0.0
    assert cispo_grad.item() == pytest.approx(-4.0 * 1.5)
    _, metrics = project_loss("cispo")(logprobs, old, advantage, mask, **counts)
    assert metrics["clipfrac_high"] == 1.0 and metrics["ratio_mean"] == pytest.approx(6.0)
    # below the cap the weight is the ratio itself
    _, below = value_and_grad(project_loss("cispo"), old + 0.5, old, advantage, mask, **counts)
    assert below.item() == pytest.approx(-torch.exp(torch.tensor(0.5)).item() * 1.5)


# ------------------------------------------------------------------------------------------------- registry

def test_default_objective_is_the_dapo_loss_with_the_schema_settings():
    logprobs, old, advantages, mask = random_batch(5, 0.3)
    counts = dict(num_tokens=17, num_sequences=None)
    got = value_and_grad(build_policy_loss(AlgorithmConfig()), logprobs, old, advantages, mask, **counts)
    want = value_and_grad(policy_loss, logprobs, old, advantages, mask, **counts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    rewards = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    torch.testing.assert_close(build_advantage_estimator(AlgorithmConfig())(rewards),
                               (rewards - rewards.mean()) / (rewards.std() + AlgorithmConfig().advantage_eps))


def test_dual_clip_belongs_to_dapo_only():
    """A negative-advantage token whose ratio exploded: dapo bounds its loss at c·|A|; gspo/cispo ignore c."""
    logprobs, old = torch.tensor([[3.0, 0.0]], dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    advantage, mask, counts = torch.tensor([-1.0]), torch.ones(1, 2), dict(num_tokens=None, num_sequences=None)
    dapo = [project_loss("dapo", clip_ratio_c=c)(logprobs, old, advantage, mask, **counts)[0] for c in (3.0, None)]
    assert dapo[0] != dapo[1]  # control: the dual clip changes this case
    for name in ("gspo", "gspo_token", "cispo"):
        with_c, without = (project_loss(name, clip_ratio_c=c)(logprobs, old, advantage, mask, **counts)
                           for c in (3.0, None))
        assert with_c[0] == without[0] and with_c[1]["clipfrac_dual"] == 0.0


def test_every_registered_objective_loads_and_an_unknown_one_is_a_config_error():
    assert set(POLICY_LOSSES) == {"dapo", "gspo", "gspo_token", "cispo"} and set(ADVANTAGE_ESTIMATORS) == {"grpo"}
    for name in POLICY_LOSSES:
        assert load_config(TINY, [f"algorithm.policy_loss={name}"]).algorithm.policy_loss == name
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss: must be one of \['dapo', 'gspo', 'gspo_token', "
                                          r"'cispo'\], got 'ppo'"):
        load_config(TINY, ["algorithm.policy_loss=ppo"])
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator: must be one of \['grpo'\], got 'rloo'"):
        load_config(TINY, ["algorithm.advantage_estimator=rloo"])
    # a config built in code skips the loader's type check: the registry names the unknown name itself
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss: unknown policy_loss 'ppo'; registered: cispo, "
                                          r"dapo, gspo, gspo_token"):
        build_policy_loss(AlgorithmConfig(policy_loss="ppo"))


def test_the_schemas_names_are_the_registries_keys():
    """The config's Literal types (what the loader accepts) and the registries (what builds) list the same names:
    a new objective added to one and not the other fails here."""
    import typing

    from dapo_megatron.config.algorithm import AdvantageEstimatorName, PolicyLossName

    from dapo_megatron.config.algorithm import OBJECTIVE_DEFAULTS

    assert set(typing.get_args(PolicyLossName)) == set(POLICY_LOSSES) == set(OBJECTIVE_DEFAULTS)
    assert set(typing.get_args(AdvantageEstimatorName)) == set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ConfigError, match=r"algorithm.gspo.eps_low: must be in \[0, 1\)"):
        load_config(TINY, ["algorithm.policy_loss=gspo", "algorithm.gspo.eps_low=1.5"])
    with pytest.raises(ConfigError, match=r"algorithm.cispo.eps_high_is: must be >= 0"):
        load_config(TINY, ["algorithm.cispo.eps_high_is=-1"])


def test_objective_settings_come_from_the_schema():
    config = load_config(TINY, ["algorithm.policy_loss=gspo"]).algorithm
    assert (config.gspo.eps_low, config.gspo.eps_high) == (3e-4, 4e-4)  # the paper's, not DAPO's 0.2 / 0.28
    assert (config.cispo.eps_low_is, config.cispo.eps_high_is) == (1.0, 3.0)
    # a setting the registry binds reaches the loss: a wider GSPO range unclips what the default clips
    logprobs, old, advantages, mask = random_batch(6, 0.01)
    counts = dict(num_tokens=None, num_sequences=None)
    narrow = project_loss("gspo")(logprobs, old, advantages, mask, **counts)[1]
    wide = build_policy_loss(AlgorithmConfig(policy_loss="gspo", gspo=type(config.gspo)(eps_low=0.1, eps_high=0.1)))
    assert narrow["clipfrac_high"] > 0 and wide(logprobs, old, advantages, mask, **counts)[1]["clipfrac_high"] == 0


# ------------------------------------------------------------------------------- an objective owns its defaults

def paper_gspo(logprobs, old, advantages, mask, eps_low, eps_high):
    """GSPO's eq. (5) as the paper writes it: −(1/G) Σ_i min(s_i·Â_i, clip(s_i, 1 − ε_low, 1 + ε_high)·Â_i), with
    s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|); responses without loss tokens are not in the group's mean."""
    terms = []
    for i in range(logprobs.shape[0]):
        keep = mask[i].bool()
        if keep.any():
            s = torch.exp((logprobs[i][keep] - old[i][keep]).sum() / keep.sum())
            terms.append(torch.minimum(s * advantages[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * advantages[i]))
    return -torch.stack(terms).mean()


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_policy_loss_gspo_alone_trains_the_papers_objective(name):
    config = load_config(TINY, [f"algorithm.policy_loss={name}"]).algorithm
    assert config.objective_defaults_applied == {"loss_agg": "seq-mean-token-mean"}
    counts = dict(num_tokens=None, num_sequences=None)
    for shift in (0.0, 0.01):  # inside the clip range, and past it
        batch = random_batch(11, shift)
        got, got_grad = value_and_grad(build_policy_loss(config), *batch, **counts)
        want, want_grad = value_and_grad(paper_gspo, *batch, **GSPO_EPS)
        close(got, want)
        close(got_grad, want_grad)
    # control: DAPO's token-mean, what `policy_loss: gspo` alone trained before, is another objective on this batch
    token_mean = build_policy_loss(AlgorithmConfig(policy_loss=name, loss_agg="token-mean"))
    assert abs(float(value_and_grad(token_mean, *batch, **counts)[0]) - float(want)) > 1e-3


def test_a_setting_the_user_makes_wins_over_the_objectives_own():
    explicit = load_config(TINY, ["algorithm.policy_loss=gspo", "algorithm.loss_agg=token-mean"]).algorithm
    assert explicit.objective_defaults_applied == {} and explicit.aggregation == "token-mean"
    dapo = load_config(TINY).algorithm  # tiny_cpu.yaml leaves loss_agg to the objective: DAPO's token-mean
    assert dapo.objective_defaults_applied == {"loss_agg": "token-mean"} and dapo.aggregation == "token-mean"


def test_the_resolved_config_says_which_defaults_the_objective_applied(tmp_path):
    config = load_config(TINY, ["algorithm.policy_loss=gspo"])
    save_config(config, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert text.splitlines()[0] == ("# algorithm.policy_loss=gspo applied its paper's "
                                    "algorithm.loss_agg=seq-mean-token-mean (not set in the config)")
    assert load_config(tmp_path / "config.yaml").algorithm.loss_agg == "seq-mean-token-mean"  # explicit once saved
    assert config_to_dict(config)["algorithm"]["loss_agg"] == "seq-mean-token-mean"
    # a GSPO run that trained with token-mean (before the objective owned its defaults) is not resumed silently
    previous = config_to_dict(config)
    previous["algorithm"]["loss_agg"] = "token-mean"
    with pytest.raises(ConfigError, match="algorithm.loss_agg 'token-mean' -> 'seq-mean-token-mean'"):
        check_resume_config(previous, config, where="the checkpoint")
