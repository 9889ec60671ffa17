"""The one interface every model judge talks to, and the cache in front of it.

    backend.chat(messages, n, temperature, max_tokens, seed=None) -> list[str]   # n reply texts

`seed` (an int, or None: the backend's own draws) makes a sampled reply reproducible where the
backend can: our sampler always, an OpenAI-compatible endpoint on a best-effort basis (its `seed`).

A backend raises `BackendError` (with a reason safe to record) when it cannot answer; judges turn
that into a failed verdict and the run continues. Implementations: `HttpChatBackend` (any
OpenAI-compatible endpoint, http_backend.py) and `LocalChatBackend` (our sampler, local_backend.py).
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from steprl_jax.judges.cache import ReplyCache

Messages = Sequence[Mapping[str, Any]]


class BackendError(RuntimeError):
    """A backend gave up; `str(error)` is a short reason without credentials."""


class ChatBackend(Protocol):
    def chat(self, messages: Messages, n: int, temperature: float, max_tokens: int,
             seed: int | None = None) -> list[str]:
        ...

    def cache_identity(self) -> dict:
        """What, besides the arguments of `chat`, decides the replies (endpoint, model, settings)."""
        ...


class CachedBackend:
    """Answers repeated requests from disk; asks `backend` only for requests it has not seen."""

    def __init__(self, backend: ChatBackend, cache: ReplyCache):
        self.backend = backend
        self.cache = cache

    def cache_identity(self) -> dict:
        return self.backend.cache_identity()

    def request(self, messages: Messages, n: int, temperature: float, max_tokens: int,
                seed: int | None = None) -> dict:
        request = {**self.backend.cache_identity(), "messages": [dict(m) for m in messages], "n": n,
                   "temperature": temperature, "max_tokens": max_tokens}
        if seed is not None:  # unseeded requests keep the keys they had
            request["seed"] = seed
        return request

    def chat(self, messages: Messages, n: int, temperature: float, max_tokens: int,
             seed: int | None = None) -> list[str]:
        request = self.request(messages, n, temperature, max_tokens, seed)
        replies = self.cache.get(request)
        if replies is not None and len(replies) == n:
            return replies
        replies = self.backend.chat(messages, n, temperature, max_tokens, seed)
        self.cache.put(request, replies)
        return replies
