"""95% confidence intervals for evaluation metrics, by the bootstrap over episodes.

Steps of one episode are not independent, so step-level rates (process correctness) resample
whole episodes (a cluster bootstrap) and take the ratio of sums. A difference between two
policies evaluated on the same questions resamples the questions, paired. Deterministic for a
seed; percentile intervals.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

DRAWS = 2000


def ratio_ci(numerators: Sequence[float], denominators: Sequence[float], *, seed: int = 0,
             level: float = 0.95) -> dict:
    """sum(num) / sum(den) over units (episodes), with a cluster-bootstrap interval."""
    num = np.asarray(numerators, np.float64)
    den = np.asarray(denominators, np.float64)
    if num.size == 0 or den.sum() == 0:
        return {"value": None, "lo": None, "hi": None, "n": int(num.size)}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.size, (DRAWS, num.size))
    sums = den[idx].sum(axis=1)
    draws = num[idx].sum(axis=1) / np.where(sums > 0, sums, np.nan)
    lo, hi = np.nanpercentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return {"value": float(num.sum() / den.sum()), "lo": float(lo), "hi": float(hi), "n": int(num.size)}


def mean_ci(values: Sequence[float], *, seed: int = 0, level: float = 0.95) -> dict:
    """Mean of per-episode values with a bootstrap interval."""
    return ratio_ci(values, np.ones(len(values)), seed=seed, level=level)


def paired_diff_ci(a: dict, b: dict, *, seed: int = 0, level: float = 0.95) -> Optional[dict]:
    """Difference (b - a) of ratio metrics over the questions both evaluated.

    `a` and `b` map a question id to (numerator, denominator) summed over its episodes."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return None
    na, da = (np.asarray([a[k][i] for k in keys], np.float64) for i in (0, 1))
    nb, db = (np.asarray([b[k][i] for k in keys], np.float64) for i in (0, 1))
    if da.sum() == 0 or db.sum() == 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(keys), (DRAWS, len(keys)))
    with np.errstate(invalid="ignore", divide="ignore"):
        draws = nb[idx].sum(1) / db[idx].sum(1) - na[idx].sum(1) / da[idx].sum(1)
    lo, hi = np.nanpercentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return {"value": float(nb.sum() / db.sum() - na.sum() / da.sum()), "lo": float(lo), "hi": float(hi),
            "n": len(keys), "excludes_zero": bool(lo > 0 or hi < 0)}


def diff_cell(ci: Optional[dict], mark: str) -> str:
    """A `paired_diff_ci` result as a table cell: '+0.125 [-0.031, +0.281]', then `mark` when
    the interval excludes 0; 'n/a' for None."""
    if ci is None:
        return "n/a"
    return f"{ci['value']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}]{mark if ci['excludes_zero'] else ''}"
