"""Jitted KV-cache sampling for agent rollouts: prefill, generate (stop strings, log-probs),
append (continue from a cache), fork (copy rows for tree rollouts). See `sampler.py`."""
from steprl_jax.sampling.params import FINISH_REASONS, Generation, SamplingParams, bucket
from steprl_jax.sampling.sampler import ContextOverflowError, Sampler, SamplerState

__all__ = [
    "ContextOverflowError", "FINISH_REASONS", "Generation", "Sampler", "SamplerState", "SamplingParams",
    "bucket",
]
