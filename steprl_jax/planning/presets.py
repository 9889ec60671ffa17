"""The papers' set-ups as plans (`python -m steprl_jax.plan --preset NAME`).

PORTool (Qwen2.5-7B-Instruct, Qwen3-1.7B): n = 8 rollout trees per query, up to 6 tool steps,
a packed tree row of up to 8,192 tokens; one row per chip per micro-batch. SWiRL (Gemma-2-27B):
a state of up to 4,096 tokens and its G = 4 sampled actions as branches of one row. Llama-3.1-8B:
the PORTool shapes. The sampler decodes 64 rows at once over the slice (8 queries x 8 trees; each
host its share) with a cache as long as a row; "-lora" variants train rank-16 adapters. No preset has a KL term (the papers use none
or a small one: add --kl).
"""
from __future__ import annotations

import dataclasses

from steprl_jax.planning.programs import Setup

# Rows this long keep only each layer's input for the backward pass (`remat`; the run's
# --config.rl.remat / --config.swirl.train.remat): the projections' outputs of every layer of an
# 8,192-token row would take as much memory again.
_PORTOOL = dict(length=8192, tree=True, decode_batch=64, context=8192, remat="nothing_saveable")
_SWIRL = dict(length=4096, tree=True, decode_batch=64, context=4096, remat="nothing_saveable")

_BASE = {
    "portool-qwen2.5-7b": Setup(model="qwen2.5-7b", **_PORTOOL),
    "portool-qwen3-1.7b": Setup(model="qwen3-1.7b", **_PORTOOL),
    "swirl-gemma-2-27b": Setup(model="gemma-2-27b", **_SWIRL),
    "llama-3.1-8b": Setup(model="llama-3.1-8b", **_PORTOOL),
}
PRESETS = {**_BASE, **{f"{k}-lora": dataclasses.replace(v, lora_rank=16) for k, v in _BASE.items()}}


def preset(name: str) -> Setup:
    """A paper's set-up; the batch (rows per step) is set to the slice's chips by the caller."""
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown {name!r}; one of {', '.join(PRESETS)}")
    return PRESETS[name]
