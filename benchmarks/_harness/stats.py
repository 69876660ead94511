"""Interleaving and the statistics every benchmark reports: medians, quartiles, intervals."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")
#: Resamples behind a ratio's 95% interval; seeded, so a report is reproducible from its times.
BOOTSTRAP_RESAMPLES = 2000


def rotated(names: Sequence[T], rep: int) -> list[T]:
    """Round-robin order for one repetition: each strategy leads in turn."""
    k = rep % len(names)
    return [*names[k:], *names[:k]]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def quartiles(values: Sequence[float]) -> list[float]:
    """The three quartiles (one value stands for all three)."""
    return statistics.quantiles(values, n=4) if len(values) > 1 else list(values) * 3


def ratio_interval(times: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """95% bootstrap interval of ``median(times) / median(baseline)``: how far the ratio of
    medians could move by noise alone, given the spread of each side's steps."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(times), np.asarray(baseline)
    picks_a = rng.integers(0, len(a), (BOOTSTRAP_RESAMPLES, len(a)))
    picks_b = rng.integers(0, len(b), (BOOTSTRAP_RESAMPLES, len(b)))
    ratios = np.median(a[picks_a], axis=1) / np.median(b[picks_b], axis=1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(low), float(high)


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """95% bootstrap interval of ``median(values)``: where the median could lie by noise
    alone, given the spread of the values."""
    rng = np.random.default_rng(0)
    a = np.asarray(values)
    medians = np.median(a[rng.integers(0, len(a), (BOOTSTRAP_RESAMPLES, len(a)))], axis=1)
    low, high = np.quantile(medians, [0.025, 0.975])
    return float(low), float(high)
