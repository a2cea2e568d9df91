"""Intervals for small-sample tables: exact binomial for accuracies, paired bootstrap for drops.

Glossary
    t-interval        mean +- t_{(1+confidence)/2, n-1} * std / sqrt(n), Student's t quantile from
                      scipy.stats (a mean over facts, prompts, ...; NaN bounds for fewer than 2 values)
    Clopper-Pearson   the exact binomial interval of a proportion k/n: the quantiles of
                      Beta(k, n-k+1) and Beta(k+1, n-k) (coverage >= 1 - alpha for every true p).
    paired bootstrap  a drop is a mean over the same examples with and without an intervention,
                      so the examples are resampled together (one draw of example indices used
                      for both runs, and for both units when two drops are compared).
    separable         unit i is separable from unit j when the bootstrap interval of
                      (effect_i - effect_j), paired over examples, excludes 0.
    draws             bootstrap resamples (2,000 by default, seeded: the same numbers on every run).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hooked.validate import Integer, Number, checked

CONFIDENCE = Number(gt=0, lt=1)  # a confidence level, open at both ends


def _beta_quantile(q: float, a: float, b: float) -> float:
    """Quantile of Beta(a, b) by bisection on the regularised incomplete beta (via torch.special)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _beta_cdf(x: float, a: float, b: float) -> float:
    """Regularised incomplete beta I_x(a, b) for integer-valued a, b >= 1: the binomial tail."""
    n = int(round(a + b - 1))
    k = int(round(a))
    # I_x(k, n - k + 1) = P(Binomial(n, x) >= k)
    ks = torch.arange(k, n + 1, dtype=torch.float64)
    logc = torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64)) - torch.lgamma(ks + 1) - torch.lgamma(n - ks + 1)
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    terms = logc + ks * math.log(x) + (n - ks) * math.log1p(-x)
    return float(terms.exp().sum())


@checked(confidence=CONFIDENCE)
def mean_interval(values: Tensor, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the t-interval of the mean of `values` (glossary)."""
    from scipy.stats import t

    v = values.double().reshape(-1)
    mean = float(v.mean()) if len(v) else math.nan
    if len(v) < 2:
        return mean, math.nan, math.nan
    half = float(t.ppf((1 + confidence) / 2, len(v) - 1)) * float(v.std()) / math.sqrt(len(v))
    return mean, mean - half, mean + half


@checked(n=Integer(ge=1), k=Integer(ge=0, le=lambda args: args["n"]), confidence=CONFIDENCE)
def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval (lower, upper) for k successes in n trials (0 <= k <= n, n >= 1)."""
    alpha = 1 - confidence
    lower = 0.0 if k == 0 else _beta_quantile(alpha / 2, k, n - k + 1)
    upper = 1.0 if k == n else _beta_quantile(1 - alpha / 2, k + 1, n - k)
    return lower, upper


def bootstrap_indices(n: int, draws: int = 2000, seed: int = 0) -> Tensor:
    """[draws n] example indices resampled with replacement (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (draws, n), generator=g)


@checked(confidence=CONFIDENCE, draws=Integer(ge=1))
def paired_interval(diff: Tensor, confidence: float = 0.95, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(diff), diff[i] a per-example paired difference."""
    diff = diff.double().reshape(-1)
    if diff.numel() == 0:
        raise ValueError("paired_interval needs at least one example")
    means = diff[bootstrap_indices(diff.numel(), draws, seed)].mean(-1)
    alpha = 1 - confidence
    q = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means, q).tolist()
    return lo, hi


def separable(effect_a: Tensor, effect_b: Tensor, confidence: float = 0.95, draws: int = 2000,
              seed: int = 0) -> tuple[bool, tuple[float, float]]:
    """Is mean(effect_a) - mean(effect_b) bounded away from 0? (answer, its paired bootstrap interval)."""
    lo, hi = paired_interval(effect_a.double() - effect_b.double(), confidence, draws, seed)
    return (lo > 0 or hi < 0), (lo, hi)
