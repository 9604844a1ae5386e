"""bench/lora_vs_full_report.py: the ratio of LoRA's held-out gain to full fine-tuning's, its standard error over
seeds and the verdict against the bar of 2/3."""

from __future__ import annotations

import math
import statistics

import pytest

import lora_vs_full_report as lora_report  # bench/ is on sys.path (pyproject.toml's pytest `pythonpath`)


def test_paired_gains_in_proportion_have_no_seed_noise_in_their_ratio():
    full = {0: 0.10, 1: 0.15, 2: 0.20}
    lora = {seed: 0.7 * gain for seed, gain in full.items()}
    ratio = lora_report.gain_ratio(lora, full)
    assert ratio.value == pytest.approx(0.7)
    assert ratio.se == pytest.approx(0.0, abs=1e-6)  # the seed moves both alike: pairing cancels it
    # the same gains on different seeds are not paired: their spread is noise
    unpaired = lora_report.gain_ratio({seed + 10: gain for seed, gain in lora.items()}, full)
    assert unpaired.value == pytest.approx(0.7)
    var_lora = statistics.variance(lora.values()) / 3
    var_full = statistics.variance(full.values()) / 3
    assert unpaired.se == pytest.approx(math.sqrt(var_lora + 0.49 * var_full) / 0.15)


def test_a_verdict_needs_the_bar_beyond_two_standard_errors():
    assert lora_report.Ratio(0.90, 0.10).verdict() == "reaches 2/3 beyond seed noise"
    assert lora_report.Ratio(0.40, 0.10).verdict() == "misses 2/3 beyond seed noise"
    assert lora_report.Ratio(0.70, 0.10).verdict() == "above 2/3, within seed noise of it"
    assert lora_report.Ratio(0.60, 0.10).verdict() == "below 2/3, within seed noise of it"
    assert lora_report.Ratio(0.90, None).verdict() == "one seed: no verdict"


def test_no_ratio_without_a_full_fine_tuning_gain():
    assert lora_report.gain_ratio({0: 0.1}, {}) is None
    assert lora_report.gain_ratio({0: 0.1}, {0: -0.05}) is None
    assert lora_report.gain_ratio({0: 0.1}, {0: 0.2}).se is None  # one seed
