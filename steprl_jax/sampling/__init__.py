"""Jitted KV-cache sampling for agent rollouts: prefill, generate (stop strings, log-probs),
append (continue from a cache), fork (copy rows for tree rollouts). See `sampler.py`.

`chat_engine.py` batches concurrent chat requests (the server, the local judge) into sampler calls;
`chat_format.py` turns OpenAI chat messages into prompt text and tool calls back. Neither is
imported here: import them by module."""
from steprl_jax.sampling.params import FINISH_REASONS, Generation, SamplingParams
from steprl_jax.sampling.sampler import ContextOverflowError, Sampler, SamplerState
from steprl_jax.shapes import bucket

__all__ = [
    "ContextOverflowError", "FINISH_REASONS", "Generation", "Sampler", "SamplerState", "SamplingParams",
    "bucket",
]
