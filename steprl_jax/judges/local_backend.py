"""A chat backend on a local model through our sampler (`sampling.chat_engine.ChatEngine`, the engine the
server runs, without HTTP).

Concurrent `chat` calls from a judge's thread pool are batched into shared generate calls.
"""
from __future__ import annotations

from steprl_jax.judges.backends import BackendError, Messages
from steprl_jax.sampling.chat_engine import ChatEngine
from steprl_jax.sampling.chat_format import RequestError


class LocalChatBackend:
    """`LocalChatBackend(model, tokenizer)`, or `LocalChatBackend(engine=...)` to share a running engine."""

    def __init__(self, model=None, tokenizer=None, *, engine: ChatEngine | None = None,
                 max_context: int | None = None, seed: int = 0, max_batch_rows: int = 32, name: str | None = None):
        if engine is None:
            if model is None or tokenizer is None:
                raise ValueError("LocalChatBackend needs (model, tokenizer) or engine=")
            engine = ChatEngine(model, tokenizer, max_context=max_context, seed=seed,
                                max_batch_rows=max_batch_rows, max_n=64)
        self.engine = engine
        tokenizer = engine.tokenizer
        self.name = name or str(getattr(tokenizer, "name_or_path", "") or "local")
        self.seed = seed

    def cache_identity(self) -> dict:
        # A local model has no endpoint; its name and seed stand for it (weights change: use another cache_dir).
        return {"endpoint": "local", "model": self.name, "seed": self.seed}

    def chat(self, messages: Messages, n: int, temperature: float, max_tokens: int,
             seed: int | None = None) -> list[str]:
        try:
            return [c.text for c in self.engine.complete(list(messages), n=n, temperature=temperature,
                                                         max_tokens=max_tokens, seed=seed)]
        except RequestError as error:  # e.g. the judge prompt is longer than the context
            raise BackendError(str(error)) from None

    def close(self) -> None:
        self.engine.close()
