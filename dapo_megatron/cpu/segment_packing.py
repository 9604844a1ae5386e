"""The CPU backend's packed layout, "segments": one row per micro-batch, each prompt once, its responses after it.

The CPU attention (:class:`dapo_megatron.cpu.attention.PackedSequenceAttention`) attends per *view*, a
sample's prompt positions followed by its response positions, so samples that share a prompt (the G responses of a
GRPO/DAPO group) need the prompt in the row only once: every layer's projections, MLP and norms then run on
``P + Σ R`` tokens instead of ``G·P + Σ R``. A response's last token is left out too: it predicts nothing, and no
later token of its sample attends to it.

Row of one micro-batch, per *unit* (one prompt and some of its responses, consecutive)::

    prompt (P tokens) ‖ response 1 without its last token ‖ response 2 without its last token ‖ ...

then padding to a multiple of ``pad_to_multiple`` (its own view). Response token ``t`` of a sample is predicted by
the logits at the last prompt position (``t = 0``) or at its own token ``t − 1``. A prompt's positions belong to the
view of the unit's first sample (its outputs are taken from there); each response position to its own view.

:class:`SegmentPacker` is this layout as the CPU backend's :class:`~dapo_megatron.backend.interfaces.RowPacker`.
Binning (:func:`segment_bins`): samples are grouped by prompt (identical token ids, in first-appearance order); a
group larger than the budget is cut into units that fit (each unit repeats the prompt); units are placed first-fit
decreasing. Deterministic: the same samples in the same order give the same rows on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dapo_megatron.cpu.attention import SegmentedRow
from dapo_megatron.policy.packing import (
    PAD_TOKEN_ID,
    MicroBatch,
    PolicySample,
    first_fit_decreasing,
    response_tensors,
    round_up,
)


def _row_length(samples: Sequence[PolicySample], unit: Sequence[int]) -> int:
    return samples[unit[0]].prompt_length + sum(samples[i].response_length - 1 for i in unit)


def prompt_units(samples: Sequence[PolicySample], indices: Sequence[int], token_budget: int) -> list[list[int]]:
    """``indices`` grouped by identical prompt (first-appearance order), each group cut into consecutive units of at
    most ``token_budget`` row tokens (a single sample over the budget stays a unit of its own)."""
    groups: dict[bytes, list[int]] = {}
    for index in indices:
        groups.setdefault(samples[index].prompt_ids.numpy().tobytes(), []).append(index)
    units = []
    for members in groups.values():
        unit: list[int] = []
        length = samples[members[0]].prompt_length
        for index in members:
            added = samples[index].response_length - 1
            if unit and length + added > token_budget:
                units.append(unit)
                unit, length = [], samples[index].prompt_length
            unit.append(index)
            length += added
        units.append(unit)
    return units


def segment_bins(samples: Sequence[PolicySample], indices: Sequence[int], token_budget: int) -> list[list[int]]:
    """The micro-batches' sample indices (units kept together, in unit order): first-fit decreasing over units."""
    units = prompt_units(samples, indices, token_budget)
    bins = first_fit_decreasing([_row_length(samples, unit) for unit in units], token_budget)
    return [[index for u in members for index in units[u]] for members in bins]


def length_classes(lengths: Sequence[int]) -> list[tuple[list[int], int]]:
    """Views grouped for attention: longest first, a view joins the current class while it is at least half as long
    as the class's longest (its padding then costs at most 4x its own scores). ``[(view numbers, longest)]``."""
    classes: list[tuple[list[int], int]] = []
    for number in sorted(range(len(lengths)), key=lambda n: (-lengths[n], n)):
        if not classes or 2 * lengths[number] < classes[-1][1]:
            classes.append(([], lengths[number]))
        classes[-1][0].append(number)
    return classes


def segmented_row(samples: Sequence[PolicySample], indices: Sequence[int], pad_to_multiple: int) -> MicroBatch:
    """One row holding ``indices`` (consecutive samples with the same prompt share it), as the module docstring lays
    it out. Plain Python lists until the end: one tensor op per field, not per sample."""
    tokens: list[int] = []
    positions: list[int] = []
    views: list[list[int]] = []  # row positions each view reads, in order
    owned_from: list[int] = []  # first column of each view whose positions the view owns
    predictors: list[int] = []  # per response token, in sample order: the row position whose logits predict it
    previous_prompt = None
    for index in indices:
        sample = samples[index]
        prompt_length = sample.prompt_length
        if previous_prompt is None or not torch.equal(sample.prompt_ids, previous_prompt):
            prompt_start = len(tokens)
            tokens += sample.prompt_ids.tolist()
            positions += range(prompt_length)
            prompt_positions = list(range(prompt_start, prompt_start + prompt_length))
            owns_prompt = True
            previous_prompt = sample.prompt_ids
        start = len(tokens)
        kept = sample.response_length - 1
        tokens += sample.response_ids[:-1].tolist()
        positions += range(prompt_length, prompt_length + kept)
        response_positions = list(range(start, start + kept))
        predictors.append(prompt_positions[-1])
        predictors += response_positions
        if owns_prompt or kept:
            views.append(prompt_positions + response_positions)
            owned_from.append(0 if owns_prompt else prompt_length)
        owns_prompt = False
    real = len(tokens)
    total = round_up(max(real, 1), pad_to_multiple)
    if total > real:  # padding: a view of its own
        views.append(list(range(real, total)))
        owned_from.append(0)
        tokens += [PAD_TOKEN_ID] * (total - real)
        positions += range(total - real)

    classes = length_classes([len(view) for view in views])
    gather: list[int] = []
    slot = [0] * total
    labels = [0] * total  # the next token along each position's owning view; a shared prompt's end: its owner's
    for members, longest in classes:
        for number in members:
            view, first, base = views[number], owned_from[number], len(gather)
            gather += view + [view[0]] * (longest - len(view))
            for column in range(first, len(view)):
                slot[view[column]] = base + column
                if column + 1 < len(view):
                    labels[view[column]] = tokens[view[column + 1]]
    response_ids = [token for index in indices for token in samples[index].response_ids.tolist()]
    for position, token in zip(reversed(predictors), reversed(response_ids)):
        labels[position] = token
    row = SegmentedRow(classes=tuple((len(members), longest) for members, longest in classes),
                       positions=torch.tensor(positions, dtype=torch.long),
                       gather=torch.tensor(gather, dtype=torch.long), slot=torch.tensor(slot, dtype=torch.long))
    return MicroBatch(
        torch.tensor(tokens, dtype=torch.long)[None], row.positions[None], torch.tensor(labels, dtype=torch.long)[None],
        None, row, *response_tensors(samples, indices, (), predictors), sample_indices=tuple(indices),
        num_real_tokens=real,
    )


class SegmentPacker:
    """The segments layout as a :class:`~dapo_megatron.backend.interfaces.RowPacker`."""

    def bins(self, samples: Sequence[PolicySample], indices: Sequence[int], token_budget: int) -> list[list[int]]:
        return segment_bins(samples, indices, token_budget)

    def row(self, samples: Sequence[PolicySample], indices: Sequence[int], pad_to_multiple: int) -> MicroBatch:
        return segmented_row(samples, indices, pad_to_multiple)
