"""Sampling parameters, per-call results, and the static descriptions of the compiled programs
(their sizes are `shapes.bucket`s)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

FINISH_REASONS = ("running", "stop", "eos", "length", "context")
RUNNING, STOP, EOS, LENGTH, CONTEXT = range(5)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen, and which distribution its log-prob is recorded under.

    Every step forms `z = softcap(h @ W.T) / temperature` (float32; `scaled_logits` of
    `steprl_jax.ops.logprobs`) and

    * greedy: picks `argmax z` (the temperature does not change the choice);
    * otherwise: samples from `softmax(z)` restricted to the `top_k` largest entries and then
      to the smallest prefix of them (sorted by probability) whose mass reaches `top_p`.

    The recorded log-prob of the chosen token (and the entropy, if asked for) is always that of
    the *untruncated* tempered distribution, `log_softmax(z)[token]`, computed by
    `steprl_jax.ops.logprobs.token_logprobs` — exactly what the trainer recomputes with the same
    temperature. Under top-k/top-p the token was actually drawn from the renormalised truncated
    distribution; the recorded value is not its probability under that one (the truncation is
    treated as part of the environment, as in most PPO/GRPO code). Greedy decoding records
    log-probs at `temperature` too (1.0 by default).

    `top_k` is part of the compiled program (one program per distinct k); `temperature` and
    `top_p` are traced values (changing them does not recompile).
    """

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0  # 1.0: no nucleus truncation
    greedy: bool = False
    with_entropy: bool = False

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r} "
                             "(use greedy=True for argmax decoding)")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclasses.dataclass
class Generation:
    """What one row produced in one `generate` call.

    `tokens` are exactly the sampled ids (the last one included when it is EOS or completes a
    stop string) and `logprobs[i]` is the recorded log-prob of `tokens[i]` (see
    `SamplingParams`). `text` is the decoded text of `tokens`, cut right after the first
    completed stop string; `text_after_stop` is whatever the final token carried beyond it
    (e.g. a newline glued to `>`) — it is part of the model's context all the same. EOS and
    other special tokens contribute no text.

    finish_reason: `running` (not finished yet: `generate` returned early, see its `max_steps`
    and `return_on_finish`; `text` is None), `stop` (a stop string completed), `eos` (a stop token id was sampled),
    `length` (max_new_tokens reached; also rows given max_new_tokens=0), `context` (the row
    reached the context limit, or the cache could not grow further).
    """

    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    finish_reason: str
    entropies: Optional[np.ndarray] = None  # float32 [n]
    text: Optional[str] = None
    stop_string: Optional[str] = None
    text_after_stop: str = ""
    # int32 [n]: the policy version (`Sampler.version`) that sampled each token; a weight push
    # between two calls of a continued row shows where it landed
    versions: Optional[np.ndarray] = None
    stop_state: int = 0  # the stop-string automaton's state, for continuing a `running` row


@dataclasses.dataclass(frozen=True)
class ExtendProgram:
    """Static description of one compiled `extend` (prefill / append) program."""

    batch: int
    length: int  # new tokens per row (bucketed)
    cache_length: int
    fresh: bool = False  # an empty cache (a prefill's first chunk): fused attention where there is one
    shared: int = 0  # slots of the shared segment the rows attend over beside their own


@dataclasses.dataclass(frozen=True)
class DecodeProgram:
    """Static description of one compiled decode loop: everything that changes the program."""

    batch: int
    cache_length: int
    max_new: int  # output buffer length (bucketed); per-row limits are traced
    greedy: bool
    top_k: int
    top_p: bool  # whether nucleus truncation is applied (its value is traced)
    with_entropy: bool
    stop_ids: tuple  # stop token ids (EOS)
    stop_states: int  # rows of the stop-string table (0: no stop strings)
    max_context: int
    shared: int = 0  # slots of the shared segment the rows attend over beside their own
