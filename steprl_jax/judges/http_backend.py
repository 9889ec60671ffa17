"""A chat backend for any OpenAI-compatible `/v1/chat/completions` endpoint (standard library only).

* The API key is read from an environment variable, sent only in the Authorization header, and never
  appears in a repr, a log line, an error reason or a cache key.
* Each attempt has a time limit, `timeout_s` per socket operation and for the whole reply body (a
  server that trickles its body byte by byte is cut off too: an attempt takes at most about twice
  `timeout_s`); timeouts, connection errors, 408/425/429/5xx and malformed replies are retried,
  other 4xx fail at once. Before a retry it waits what the server's Retry-After says (seconds or an
  HTTP date; at least `backoff_s` x U(0.5, 1), so `Retry-After: 0` still waits a little), capped at
  `max_backoff_s`, times a jitter of U(1, 1.1); without Retry-After, an exponential backoff with
  jitter. After the last retry `BackendError` says why.
* At most `max_concurrency` requests are in flight at once (a semaphore, released during backoff),
  so a judge's thread pool can fan out without flooding the endpoint.
"""
from __future__ import annotations

import datetime
import email.utils
import http.client
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Mapping

from steprl_jax.judges.backends import BackendError, Messages

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_MAX_REASON_CHARS = 300


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


class HttpChatBackend:
    """`chat()` over HTTP. `base_url` ends before `/chat/completions`, e.g. "http://127.0.0.1:8000/v1"."""

    def __init__(self, base_url: str, model: str, api_key_env: str | None = None, timeout_s: float = 60.0,
                 retries: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 max_concurrency: int = 8, max_n_per_request: int = 8,
                 extra_body: Mapping[str, Any] | None = None):
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"judge base_url must be an http(s) URL, got {base_url!r}")
        if max_concurrency < 1 or max_n_per_request < 1 or retries < 0:
            raise ValueError("max_concurrency and max_n_per_request must be >= 1 and retries >= 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self._api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self._api_key:
            # A server on this machine (e.g. `python -m steprl_jax.serve`) usually needs no key.
            if parsed.hostname not in _LOOPBACK:
                raise ValueError(f"judge API key environment variable {api_key_env!r} is not set")
            log.info("%s is not set: calling the local endpoint %s without a key", api_key_env, self.base_url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_n_per_request = max_n_per_request
        self.extra_body = dict(extra_body or {})
        self._slots = threading.BoundedSemaphore(max_concurrency)
        # Loopback endpoints bypass any proxy configured in the environment.
        handlers = [urllib.request.ProxyHandler({})] if parsed.hostname in _LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)
        self._stats_lock = threading.Lock()
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0}

    def __repr__(self) -> str:
        return f"HttpChatBackend(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    def cache_identity(self) -> dict:
        return {"endpoint": self.base_url + "/chat/completions", "model": self.model, **self.extra_body}

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1

    def chat(self, messages: Messages, n: int, temperature: float, max_tokens: int,
             seed: int | None = None) -> list[str]:
        """`n` replies; endpoints that return fewer choices than asked are asked again for the rest
        (with `seed`, the later rounds with seed + round: the same seed would repeat the replies)."""
        replies: list[str] = []
        for round_ in range(2 * n):  # bounded: every useful round adds at least one reply
            if len(replies) >= n:
                break
            want = min(n - len(replies), self.max_n_per_request)
            body = {"model": self.model, "messages": [dict(m) for m in messages], "n": want,
                    "temperature": temperature, "max_tokens": max_tokens, **self.extra_body}
            if seed is not None:
                body["seed"] = seed + round_
            replies.extend(self._post(body)[:want])
        if len(replies) < n:
            raise BackendError(f"endpoint returned {len(replies)} of {n} requested choices")
        return replies

    def _post(self, body: dict) -> list[str]:
        self._count("requests")
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        last_reason = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
            try:
                with self._slots:
                    self._count("attempts")
                    return self._attempt(data)
            except _Retryable as error:
                last_reason = self._scrub(str(error))
                if attempt == self.retries:
                    break
                delay = self._delay(attempt, error.retry_after)
                log.warning("judge endpoint %s: %s; retry %d/%d in %.1fs", self.base_url, last_reason,
                            attempt + 1, self.retries, delay)
                time.sleep(delay)
            except BackendError as error:
                self._count("failures")
                raise BackendError(self._scrub(str(error))) from None
        self._count("failures")
        raise BackendError(f"{last_reason} (after {self.retries + 1} attempts)")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """How long to wait before retry `attempt + 1`.

        Without Retry-After: exponential backoff with jitter. With it: what the server asks, but never
        less than a short floor (`Retry-After: 0` or a date already past must not mean "hammer it
        now"), capped at `max_backoff_s`, then spread by up to 10% so that a judge's threads that
        were all told the same thing do not all come back at the same instant."""
        if retry_after is None:
            return min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * random.uniform(0.5, 1.0)
        floor = self.backoff_s * random.uniform(0.5, 1.0)
        return min(max(retry_after, floor), self.max_backoff_s) * random.uniform(1.0, 1.1)

    def _attempt(self, data: bytes) -> list[str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.base_url + "/chat/completions", data=data, headers=headers,
                                         method="POST")
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                payload = self._read_body(response, deadline)
        except urllib.error.HTTPError as error:
            detail = _snippet(self._scrub_bytes(error.read() if error.fp else b""))
            reason = f"HTTP {error.code}" + (f": {detail}" if detail else "")
            if error.code in RETRYABLE_STATUS:
                raise _Retryable(reason, _retry_after(error.headers)) from None
            raise BackendError(reason) from None
        except (socket.timeout, TimeoutError):
            raise _Retryable(f"timed out after {self.timeout_s:g}s") from None
        except urllib.error.URLError as error:
            if isinstance(error.reason, (socket.timeout, TimeoutError)):
                raise _Retryable(f"timed out after {self.timeout_s:g}s") from None
            raise _Retryable(f"connection failed: {error.reason}") from None
        except (ConnectionError, OSError, http.client.HTTPException) as error:  # resets, truncated replies
            raise _Retryable(f"connection failed: {type(error).__name__}: {error}") from None
        return _read_choices(self._scrub_bytes(payload))

    def _read_body(self, response, deadline: float) -> bytes:
        """The whole body, or a retryable timeout once `deadline` has passed (each read may still
        block for up to `timeout_s`, the socket's own limit)."""
        chunks = []
        while chunk := response.read1(1 << 16):
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise _Retryable(f"timed out after {self.timeout_s:g}s (the reply body was still arriving)")
        return b"".join(chunks)

    # The key is scrubbed before anything is cut short, so that no prefix of it survives in a reason.
    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def _scrub_bytes(self, raw: bytes) -> bytes:
        return raw.replace(self._api_key.encode(), b"***") if self._api_key else raw


def _snippet(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip().replace("\n", " ")
    return text[:_MAX_REASON_CHARS]


def _retry_after(headers, now: datetime.datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delay-seconds or an HTTP date (counted from
    `now`, default the current UTC time); None when absent or unreadable (then our own backoff
    applies)."""
    value = headers.get("Retry-After") if headers is not None else None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - (now or datetime.datetime.now(datetime.timezone.utc))).total_seconds())


def _read_choices(payload: bytes) -> list[str]:
    """The message texts of an OpenAI chat-completions reply; anything else is a (retryable) bad reply."""
    try:
        value = json.loads(payload)
        choices = value["choices"]
        if not isinstance(choices, list) or not choices:
            raise ValueError("no choices")
        texts = []
        for choice in sorted(choices, key=lambda c: c.get("index", 0)):
            content = choice["message"].get("content")
            if content is None:
                content = ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise ValueError("message content is not text")
            texts.append(content)
        return texts
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:  # deep nesting too
        raise _Retryable(f"malformed reply ({type(error).__name__}: {str(error)[:80]}): "
                         f"{_snippet(payload[:200])!r}") from None
