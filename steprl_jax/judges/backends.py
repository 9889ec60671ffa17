"""The one interface every model judge talks to, and the cache in front of it.

    backend.chat(messages, n, temperature, max_tokens) -> list[str]   # n reply texts

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
    def chat(self, messages: Messages, n: int, temperature: float, max_tokens: int) -> list[str]:
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

    def request(self, messages: Messages, n: int, temperature: float, max_tokens: int) -> dict:
        return {**self.backend.cache_identity(), "messages": [dict(m) for m in messages], "n": n,
                "temperature": temperature, "max_tokens": max_tokens}

    def chat(self, messages: Messages, n: int, temperature: float, max_tokens: int) -> list[str]:
        request = self.request(messages, n, temperature, max_tokens)
        replies = self.cache.get(request)
        if replies is not None and len(replies) == n:
            return replies
        replies = self.backend.chat(messages, n, temperature, max_tokens)
        self.cache.put(request, replies)
        return replies
