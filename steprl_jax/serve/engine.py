"""The chat engine: chat messages in, `n` completions out, through our jitted sampler.

Concurrent callers (HTTP handler threads, a judge's thread pool) are batched: one worker thread
takes every waiting request that shares the sampling settings and runs them as one sampler batch
(up to `max_batch_rows` rows), so many small requests cost about one generate call, not one each.
Each request has its own PRNG key (`seed`, or the engine's stream) and row j of a request uses
`fold_in(key, j)`: its samples do not depend on what else was in the batch.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from steprl_jax.sampling import Sampler, SamplingParams
from steprl_jax.serve.chat_format import RequestError, render_prompt

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" (a stop string or end of turn) | "length" (max_tokens or the context)
    prompt_tokens: int
    completion_tokens: int
    stop_string: str | None = None  # which of the request's stop strings ended it


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    params: SamplingParams
    stop: tuple[str, ...]
    key: Any  # uint32 [2] key data
    future: concurrent.futures.Future

    @property
    def batch_key(self) -> tuple:  # requests that can share one generate call
        return self.params, self.stop


class ChatEngine:
    """`complete(messages, ...) -> list[Completion]`, thread-safe, batched across callers."""

    def __init__(self, model, tokenizer, *, max_context: int | None = None, seed: int = 0,
                 max_batch_rows: int = 32, min_batch_rows: int = 1, max_n: int = 16):
        if tokenizer is None:
            raise ValueError("serving needs a tokenizer (the checkpoint has none)")
        self.tokenizer = tokenizer
        self.sampler = Sampler(model, tokenizer, max_context=max_context)
        self.max_context = self.sampler.max_context
        self.max_batch_rows = max_batch_rows
        # Batches are padded to at least this many rows, so that small requests share one compiled program.
        self.min_batch_rows = min(min_batch_rows, max_batch_rows)
        self.max_n = max_n
        self._base_key = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
        self._counter = 0
        self._pending: collections.deque[_Request] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="chat-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, messages: Any, tools: Sequence[Mapping] | None = None) -> list[int]:
        text = render_prompt(self.tokenizer, messages, tools)
        # The template already wrote any BOS/turn tokens: do not add them twice.
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise RequestError("the rendered prompt is empty")
        return ids

    def complete(self, messages: Any, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int = 256, stop: Sequence[str] = (), tools: Sequence[Mapping] | None = None,
                 seed: int | None = None) -> list[Completion]:
        """`n` completions of the chat; temperature 0 is greedy. Raises RequestError on bad input."""
        if not isinstance(n, int) or not 1 <= n <= self.max_n:
            raise RequestError(f"n must be an integer in [1, {self.max_n}]")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError("max_tokens must be a positive integer")
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise RequestError("temperature must be a number in [0, 2]")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RequestError("top_p must be a number in (0, 1]")
        stop = tuple(stop)
        if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a non-empty string or a list of at most 4 of them")
        ids = self.prompt_ids(messages, tools)
        if len(ids) >= self.max_context:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context limit is {self.max_context}")
        params = (SamplingParams(greedy=True) if temperature == 0
                  else SamplingParams(temperature=float(temperature), top_p=float(top_p)))
        request = _Request(ids, n, max_tokens, params, stop, self._request_key(seed), concurrent.futures.Future())
        with self._cv:
            if self._closed:
                raise RuntimeError("the chat engine is closed")
            self._pending.append(request)
            self._cv.notify()
        return request.future.result()

    def _request_key(self, seed: int | None) -> np.ndarray:
        if seed is not None:
            return np.asarray(jax.random.key_data(jax.random.key(int(seed))), np.uint32)
        with self._cv:
            self._counter += 1
            counter = self._counter
        return np.asarray(jax.random.fold_in(self._base_key, counter), np.uint32)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=10)

    # ------------------------------------------------------------------ the worker
    def _take_batch(self) -> list[_Request] | None:
        with self._cv:
            while not self._pending and not self._closed:
                self._cv.wait()
            if not self._pending:
                return None
            first = self._pending.popleft()
            batch, rows, keep = [first], first.n, collections.deque()
            while self._pending:
                request = self._pending.popleft()
                if request.batch_key == first.batch_key and rows + request.n <= self.max_batch_rows:
                    batch.append(request)
                    rows += request.n
                else:
                    keep.append(request)
            self._pending.extendleft(reversed(keep))
            return batch

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            try:
                results = self._generate(batch)
            except Exception as error:  # reported to each caller; the worker keeps serving
                log.exception("generation failed for a batch of %d requests", len(batch))
                for request in batch:
                    request.future.set_exception(error)
                continue
            for request, completions in zip(batch, results):
                request.future.set_result(completions)

    def _generate(self, batch: list[_Request]) -> list[list[Completion]]:
        prompts, keys, max_new = [], [], []
        for request in batch:
            for j in range(request.n):
                prompts.append(request.prompt_ids)
                keys.append(np.asarray(jax.random.fold_in(request.key, j), np.uint32))
                max_new.append(min(request.max_tokens, self.max_context - len(request.prompt_ids)))
        for _ in range(self.min_batch_rows - len(prompts)):  # padding rows generate nothing
            prompts.append(prompts[0])
            keys.append(keys[0])
            max_new.append(0)
        first = batch[0]
        longest = max(len(p) for p in prompts) + max(max_new)
        state = self.sampler.prefill(prompts, cache_length=min(longest, self.max_context))
        _, generations = self.sampler.generate(state, np.stack(keys), max_new_tokens=max_new,
                                               params=first.params, stop=first.stop)
        results, row = [], 0
        for request in batch:
            completions = []
            for gen in generations[row:row + request.n]:
                text = gen.text or ""
                if gen.stop_string is not None:  # OpenAI semantics: the stop sequence is not returned
                    text = text[:len(text) - len(gen.stop_string)]
                reason = "stop" if gen.finish_reason in ("stop", "eos") else "length"
                completions.append(Completion(text, reason, len(request.prompt_ids), int(len(gen.tokens)),
                                              gen.stop_string))
            results.append(completions)
            row += request.n
        return results
