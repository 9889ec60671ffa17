"""Frozen, hashable configuration of the train step (static arguments of the jitted program)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from steprl_jax.models.transformer import remat_policy
from steprl_jax.ops.losses import AGG_MODES, KL_ESTIMATORS

LOSS_KINDS = ("policy", "sft")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the train step minimises. Every field changes the compiled program.

    kind: "policy" (clipped surrogate on `advantages`; SWiRL, PORTool, GRPO, DAPO, ARPO) or
      "sft" (negative log-likelihood of the masked tokens).
    agg: aggregation mode (ops/losses.py); `norm` is the constant of seq_mean_token_sum_norm
      (None: the padded batch length).
    eps_low/eps_high/dual_clip: the PPO clip range (DAPO clip-higher: eps_high > eps_low).
    kl_coef/kl_estimator: KL penalty to the frozen reference policy (0 disables it).
    entropy_coef: entropy bonus (subtracted from the loss).
    temperature: the sampling temperature; log-probs are log-softmax(logits / temperature),
      exactly as the sampler records them.
    logprob_chunk: sequence positions per log-prob chunk; None: the largest power of two whose
      float32 logits fit a 256 MiB budget (`ops.logprobs.auto_chunk_size`), at most a quarter
      of the row. Only the loss mask's positions are projected onto the vocabulary: a chunk
      past every row's count of them is skipped.
    proximal_cap: decoupled PPO with the step's own forward pass as the proximal policy: the
      clip's reference is that pass's detached log-prob, and each token is weighted by
      min(pi_prox / pi_behaviour, cap), `batch.old_logp` holding the behaviour log-probs. Right
      only for an update's first step (its parameters are the proximal policy); it saves the
      separate log-prob pass (training/learner.py `train_on_rows`).
    """
    kind: str = "policy"
    agg: str = "token_mean"
    norm: Optional[float] = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    logprob_chunk: Optional[int] = None
    proximal_cap: Optional[float] = None

    def __post_init__(self):
        if self.proximal_cap is not None and not (self.kind == "policy" and self.proximal_cap > 0):
            raise ValueError(f"proximal_cap needs the policy loss and a cap > 0, got {self.kind!r}, {self.proximal_cap}")
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"loss kind must be one of {LOSS_KINDS}, got {self.kind!r}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {AGG_MODES}, got {self.agg!r}")
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be None or > 1, got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {tuple(KL_ESTIMATORS)}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.logprob_chunk is not None and self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be None (automatic) or >= 1, got {self.logprob_chunk}")

    @property
    def zero_advantages_zero_gradient(self) -> bool:
        """Whether a batch whose advantages are all 0 has a zero gradient: a policy loss without a
        KL or entropy term (such a batch may then skip its optimizer step, `train_on_rows`)."""
        return self.kind == "policy" and self.kl_coef == 0 and self.entropy_coef == 0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to `end_lr_ratio * learning_rate`, after
    clipping the global gradient norm to `max_grad_norm` (None: no clipping)."""
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = 1.0

    def __post_init__(self):
        if self.total_steps < 1 or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps ({self.warmup_steps}) <= total_steps "
                             f"({self.total_steps}) and total_steps >= 1")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
    """`remat`: the layers' rematerialisation policy for the backward pass (a
    `jax.checkpoint_policies` name or "qkvo_saveable", see `models.transformer.remat_policy`),
    or None to keep every intermediate. Recomputing made the SmolLM2 8 x 512 step faster on
    CPU (less residual traffic) and cut its peak memory ~4x; "qkvo_saveable" (keep the
    attention projections' outputs) is ~5% faster again than "nothing_saveable".

    `max_microbatch_tokens` (> 0) bounds the padded tokens (rows x row length) of one
    micro-batch per data shard: a batch is split into at least `num_microbatches` micro-batches,
    more when its shape needs it (`training.step.microbatch_count`, decided from the static shape
    when the step is traced). Activation memory follows the micro-batch, not the batch, so a long
    RL batch fits the same memory as a short one (verl's `ppo_max_token_len_per_gpu`)."""
    loss: LossConfig = LossConfig()
    num_microbatches: int = 1
    remat: Optional[str] = "qkvo_saveable"
    max_microbatch_tokens: int = 0

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.max_microbatch_tokens < 0:
            raise ValueError(f"max_microbatch_tokens must be >= 0 (0: no bound), got {self.max_microbatch_tokens}")
        if self.remat is not None:
            remat_policy(self.remat)
