"""Host-side validators: call them on NumPy arrays before data enters a jitted kernel.

Jitted kernels cannot raise on values (NaN, a cycle in a tree) without a device-to-host sync, so
the batch builders run these once per batch on the host and get an error that names the culprit.
Shape and range checks on static arguments happen inside the kernels at trace time instead.
"""
from __future__ import annotations

import numpy as np


def check_finite(name: str, array) -> None:
    """Raise if `array` holds NaN or +-inf, naming the first offending index."""
    a = np.asarray(array)
    if not np.issubdtype(a.dtype, np.floating):
        return
    bad = ~np.isfinite(a)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} holds a non-finite value {float(a[idx])} at index {idx} "
                         f"({int(bad.sum())} non-finite entries)")


def check_same_shape(**arrays) -> None:
    """Raise unless every keyword array has the same shape."""
    shapes = {k: tuple(np.shape(v)) for k, v in arrays.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shapes disagree: {shapes}")


def check_mask_selects(name: str, mask) -> None:
    """Raise if a loss mask selects no token at all (usually a batch-building bug)."""
    m = np.asarray(mask)
    if not (m != 0).any():
        raise ValueError(f"{name} selects no token (all {m.size} entries are 0)")
