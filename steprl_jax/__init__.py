"""steprl_jax: step-wise reinforcement learning for tool-using LLM agents in JAX/Flax."""

__version__ = "0.1.0"
