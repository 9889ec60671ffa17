"""The learner: the policy being trained, built in one place for the offline loop, the online loop and
the benchmarks.

    learner = Learner(model, settings, seed=0, checkpoint_dir=".../checkpoints/rl", mesh=mesh_spec)
    position = learner.restore()                 # None, or the data position saved with the state
    metrics = learner.update(rows, where="rl iteration 3")   # pack, ppo_epochs x minibatches steps
    sampler.set_params(learner.policy())         # a copy where this process samples, adapters merged
    learner.save(step, position); learner.export(tokenizer, out_dir)

It holds the train state (parameters, optimizer, step, RNG) on the trainer's mesh, the jitted train
step, the reference policy when the loss has a KL term (the initial weights; with LoRA the base, i.e.
the adapters as created), the bridge to this process's sampling devices and the checkpointer. The
train step donates its input state, so `policy()` hands out copies.

A train step whose loss, gradient norm or learning rate is not finite raises `NonFiniteError` naming
the update, the step and the metric, before anything more is saved: no checkpoint or export of such
weights.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from steprl_jax.models import lora
from steprl_jax.models.lora import LoraConfig
from steprl_jax.models.sharding import batch_sharding
from steprl_jax.ops.losses import truncated_is_weights
from steprl_jax.training import distributed
from steprl_jax.training.checkpoint import Checkpointer
from steprl_jax.training.config import LossConfig, OptimizerConfig, TrainStepConfig
from steprl_jax.training.distributed import put_global
from steprl_jax.training.optimizer import lr_schedule, make_optimizer
from steprl_jax.training.pack import cheapest_layout, pack
from steprl_jax.training.state import create_train_state, merge_model, split_model
from steprl_jax.training.step import data_shards, make_logprob_fn, make_train_step


@dataclasses.dataclass(frozen=True)
class LearnerSettings:
    loss: LossConfig
    optimizer: OptimizerConfig
    num_microbatches: int = 1
    max_microbatch_tokens: int = 0  # > 0: more micro-batches when a batch needs them (TrainStepConfig)
    remat: Optional[str] = "qkvo_saveable"  # what the backward pass keeps (TrainStepConfig)
    ppo_epochs: int = 1
    minibatches: int = 1
    min_rows: int = 0  # pad the batch to at least this many rows (fixed shapes: fewer compilations)
    max_length: Optional[int] = None
    attention_length: float = 0.0  # > 0: rows regrouped to the cheapest layout (training/pack.py)
    # A minibatch whose trained tokens all have advantage 0 takes no step (only where the loss says
    # zero advantages give a zero gradient): AdamW's momentum and weight decay would still move it.
    skip_without_signal: bool = False
    lora: Optional[LoraConfig] = None  # train low-rank adapters on a frozen copy
    # Off-policy correction (asynchronous rollouts): > 0 recomputes each token's log-prob under the
    # policy as the update starts (the proximal policy: the clip's reference) and weighs its loss by
    # min(pi_prox / pi_behaviour, cap) (`ops.losses.truncated_is_weights`). None: the sampler's
    # log-probs are the clip's reference (on-policy data: ratio 1 at the first step).
    behaviour_cap: Optional[float] = None

    def __post_init__(self):
        if self.behaviour_cap is not None and not self.behaviour_cap > 0:
            raise ValueError(f"behaviour_cap must be None or > 0, got {self.behaviour_cap}")
        if self.attention_length > 0 and self.loss.agg != "token_mean":
            raise ValueError(f"regrouping rows (attention_length > 0) keeps the loss only under the token_mean "
                             f"aggregation, not {self.loss.agg!r}")


class Learner:
    def __init__(self, model, settings: LearnerSettings, *, seed: int, checkpoint_dir: str,
                 mesh: Optional[distributed.MeshSpec] = None,
                 base_source: Optional[str] = None):
        """`model` is copied (the caller's stays usable). `mesh` (config.mesh, read once; None: one
        device): the trainer's mesh and where each process samples (training/distributed.py). With `base_source` (the
        load_pretrained source of `model`) the checkpoint folder loads as a policy itself."""
        self.settings = s = settings
        tx = make_optimizer(s.optimizer)
        spec = mesh or distributed.MeshSpec()
        self.mesh = distributed.train_mesh(spec)
        self.bridge = distributed.sampler_bridge(spec)
        self.graphdef, self.state, shardings = create_train_state(trainable_copy(model, s.lora, seed), tx, seed=seed,
                                                                  mesh=self.mesh)
        step_for = lambda loss: make_train_step(self.graphdef, tx, TrainStepConfig(  # noqa: E731
            loss=loss, num_microbatches=s.num_microbatches, max_microbatch_tokens=s.max_microbatch_tokens,
            remat=s.remat), schedule=lr_schedule(s.optimizer), mesh=self.mesh, state_shardings=shardings)
        self.step_fn = step_for(s.loss)
        # Off-policy correction: an update's first step takes the proximal log-probs from its own
        # forward pass (LossConfig.proximal_cap), the other minibatches from `logprob_fn`.
        self.proximal_step_fn = None
        if s.behaviour_cap is not None and s.ppo_epochs == 1:
            self.proximal_step_fn = step_for(dataclasses.replace(s.loss, proximal_cap=s.behaviour_cap))
        self.ref_params = self.logprob_fn = None
        if s.loss.kl_coef > 0:  # the reference policy: the initial weights, frozen, in buffers of their own
            if s.lora is not None:
                self.ref_params = jax.tree.map(jnp.copy, self.state.params)  # adapters with B = 0: the base
            else:
                _, self.ref_params, _ = split_model(copy_model(*split_model(model)))
                if self.mesh is not None:
                    self.ref_params = jax.device_put(self.ref_params, shardings.params)
        if s.loss.kl_coef > 0 or s.behaviour_cap is not None:
            self.logprob_fn = make_logprob_fn(self.graphdef, temperature=s.loss.temperature, mesh=self.mesh)
        self.ckpt = Checkpointer(checkpoint_dir, max_to_keep=2)
        if base_source is not None and distributed.is_primary():
            from steprl_jax.models.orbax_policy import write_policy_file

            write_policy_file(self.ckpt.directory, base_source)

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    def restore(self) -> Optional[dict]:
        """The latest checkpoint's data position (the state restored with it); None when there is none."""
        if self.ckpt.latest_step() is None:
            return None
        self.state, position = self.ckpt.restore(like=self.state)
        return position

    def save(self, step: int, position: dict) -> None:
        self.ckpt.save(self.state, step=step, data_position=position)

    def update(self, rows, where: str = "") -> dict:
        """Pack `rows` and run ppo_epochs x minibatches train steps (`train_on_rows`); returns metrics."""
        s = self.settings
        self.state, metrics = train_on_rows(
            self.step_fn, self.state, rows, ppo_epochs=s.ppo_epochs, minibatches=s.minibatches,
            num_microbatches=s.num_microbatches, min_rows=s.min_rows, max_length=s.max_length,
            logprob_fn=self.logprob_fn, ref_params=self.ref_params, attention_length=s.attention_length,
            mesh=self.mesh, skip_without_signal=s.skip_without_signal and s.loss.zero_advantages_zero_gradient,
            behaviour_cap=s.behaviour_cap, proximal_step_fn=self.proximal_step_fn, where=where)
        return metrics

    def policy(self):
        """The current policy where this process samples (a copy: the train step donates the state's
        buffers), LoRA adapters merged."""
        if self.bridge is None:
            return lora.merged(copy_model(self.graphdef, self.state.params, self.state.rest))
        return lora.merged(merge_model(self.graphdef, *self.bridge((self.state.params, self.state.rest))))

    def export(self, tokenizer, out_dir: str, *, adapters: bool = False, base_source: Optional[str] = None):
        return export_policy(self.graphdef, self.state, tokenizer, out_dir, adapters=adapters, base_source=base_source)

    def close(self) -> None:
        self.ckpt.close()


# A train step where one of these is not finite has made the weights unusable.
MUST_BE_FINITE = ("loss", "grad_norm", "learning_rate")


class NonFiniteError(RuntimeError):
    """Training produced a NaN or an infinity (the message names the update, the step and the metric)."""


def copy_model(graphdef, params, rest):
    """A model on fresh copies of `params`: the train step donates (deletes) its input buffers."""
    return merge_model(graphdef, jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, rest))


def trainable_copy(model, lora_config: Optional[LoraConfig] = None, seed: int = 0):
    """A copy of `model` to train: every parameter, or (with `lora_config`) adapters on a frozen copy."""
    out = copy_model(*split_model(model))
    return out if lora_config is None else lora.add_adapters(out, lora_config, seed=seed)


def _split_rows(batch, parts: int):
    if parts == 1:
        return [batch]
    n = batch.tokens.shape[0] // parts
    return [jax.tree.map(lambda x: x[i * n:(i + 1) * n], batch) for i in range(parts)]


def pack_rows(rows, *, num_microbatches: int = 1, min_rows: int = 0, max_length: Optional[int] = None,
              attention_length: float = 0.0):
    """The train batch of `rows`; with `attention_length` > 0 the rows are first regrouped to the
    layout of least estimated cost (`pack.cheapest_layout`)."""
    if attention_length > 0:
        rows = cheapest_layout(rows, attention_length=attention_length, num_microbatches=num_microbatches,
                               min_rows=min_rows, max_length=max_length)
    return pack(rows, num_microbatches=num_microbatches, min_rows=min_rows, max_length=max_length)


def train_on_rows(step_fn, state, rows, *, ppo_epochs: int = 1, minibatches: int = 1, num_microbatches: int = 1,
                  min_rows: int = 0, max_length: Optional[int] = None, logprob_fn=None, ref_params=None,
                  attention_length: float = 0.0, mesh=None, skip_without_signal: bool = False,
                  behaviour_cap: Optional[float] = None, proximal_step_fn=None, where: str = ""):
    """Pack `rows` (`pack_rows`) and run ppo_epochs x minibatches train steps; returns (state,
    metrics). The loop every algorithm shares (offline and online). With a `mesh` the rows are
    padded to a multiple of its data shards and placed over them (every process holds the same
    rows: the global batch). `skip_without_signal`: a minibatch whose trained tokens all have
    advantage 0 takes no step (its policy gradient is 0, yet AdamW's momentum and weight decay
    would still move the weights); only where `LossConfig.zero_advantages_zero_gradient`.
    `behaviour_cap`: the off-policy correction (`LearnerSettings.behaviour_cap`; needs `logprob_fn`),
    the proximal log-probs computed for every minibatch before the first step, except that with
    `proximal_step_fn` (`LossConfig.proximal_cap` set) and one epoch the first step reads them from
    its own forward pass (the update's starting parameters are the proximal policy): one log-prob
    pass fewer, and the first ratio exactly 1. A step whose loss, gradient norm or learning rate
    is not finite raises `NonFiniteError` naming `where` (e.g. "sft update 3"), the train step and
    the metric."""
    shards = data_shards(mesh)
    host = pack_rows(rows, num_microbatches=num_microbatches * minibatches * shards, min_rows=min_rows,
                     max_length=max_length, attention_length=attention_length)
    parts = _split_rows(host, minibatches)  # on the host, then each placed over the data shards
    signal = [bool(np.any((np.asarray(p.advantages) != 0) & (np.asarray(p.loss_mask) > 0))) for p in parts]
    if skip_without_signal:
        parts = [part for part, has in zip(parts, signal) if has]
    metrics = {"skipped_steps": float(ppo_epochs * (len(signal) - len(parts))),
               "signal_minibatches": float(sum(signal)), "rows": int(np.sum(np.any(host.attention_mask, axis=1))),
               "row_length": float(host.tokens.shape[1]), "tokens": float(np.sum(host.attention_mask)),
               "trained_tokens": float(np.sum(host.loss_mask > 0)), "padded_tokens": float(host.tokens.size)}
    if not parts:
        return state, {**metrics, "train_s": 0.0}
    if mesh is not None:
        parts = [put_global(part, lambda x: batch_sharding(mesh, ndim=x.ndim)) for part in parts]
    logprobs = lambda params, part: logprob_fn(params, state.rest, part.tokens, part.attention_mask, part.loss_mask,
                                               part.positions, part.branch_ids, part.branch_ends, part.key_blocks)
    if ref_params is not None:
        parts = [part.replace(ref_logp=logprobs(ref_params, part)) for part in parts]
    fused = behaviour_cap is not None and proximal_step_fn is not None and ppo_epochs == 1
    is_sums = []
    if behaviour_cap is not None:
        own = 1 if fused else 0  # minibatches whose step computes its own proximal log-probs
        rest, is_sums = _behaviour_correction(parts[own:], lambda part: logprobs(state.params, part), behaviour_cap)
        parts = parts[:own] + rest
    t1 = time.perf_counter()
    first_step = int(jax.device_get(state.step))
    step_metrics = []
    for _ in range(ppo_epochs):
        for part in parts:
            state, m = (proximal_step_fn if fused and not step_metrics else step_fn)(state, part)
            step_metrics.append(m)
    step_metrics, is_sums = jax.device_get((step_metrics, is_sums))
    check_finite(step_metrics, first_step, where)
    if fused:  # the first step's weights, back to sums
        first = step_metrics[0]
        count = first["token_count"]
        is_sums = [{"is_weight": first.pop("is_weight") * count, "is_truncated": first.pop("is_truncated") * count,
                    "is_weight_max": first.pop("is_weight_max"), "token_count": count}] + is_sums
    if is_sums:
        metrics.update(_is_metrics(is_sums))
    return state, {**_first_and_mean(step_metrics), **metrics, "train_s": time.perf_counter() - t1}


def _behaviour_correction(parts, proximal_logprobs, cap: float):
    """Each minibatch with the clip's reference set to the proximal policy's log-probs and its
    tokens weighted by `ops.losses.truncated_is_weights` against the sampler's (behaviour) ones;
    returns (parts, each one's weight sums: `_is_metrics`)."""
    out, sums = [], []
    for part in parts:
        proximal = proximal_logprobs(part)
        weights, stats = truncated_is_weights(proximal, part.old_logp, part.loss_mask, cap)
        out.append(part.replace(old_logp=proximal, is_weight=weights))
        sums.append(stats)
    return out, sums


def _is_metrics(sums: list[dict]) -> dict:
    """The importance weights' mean and max, and the fraction truncated at the cap, over minibatches."""
    count = max(sum(float(x["token_count"]) for x in sums), 1.0)
    return {"is_weight_mean": sum(float(x["is_weight"]) for x in sums) / count,
            "is_weight_max": max(float(x["is_weight_max"]) for x in sums),
            "is_truncated": sum(float(x["is_truncated"]) for x in sums) / count}


def check_finite(step_metrics: list[dict], first_step: int, where: str = "") -> None:
    """`NonFiniteError` at the first train step whose loss, gradient norm or learning rate is not
    finite (`first_step`: the state's step before the first of `step_metrics`)."""
    for i, m in enumerate(step_metrics):
        for name in MUST_BE_FINITE:
            if name in m and not math.isfinite(float(m[name])):
                raise NonFiniteError(
                    f"{where + ': ' if where else ''}{name} is {float(m[name])} at train step {first_step + i + 1}; "
                    "the weights are no longer usable, so nothing more is saved or exported. Lower the learning "
                    "rate (optimizer.learning_rate) or check the data, then resume from the last checkpoint")


def _first_and_mean(step_metrics: list[dict]) -> dict:
    """Mean of each train-step metric over the update's steps, plus the first step's ratio and
    clip fraction (1 and 0 when the sampler and the trainer agree)."""
    out = {k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]}
    first = step_metrics[0]
    for k in ("ratio", "clipfrac", "ratio_max", "ratio_min"):
        if k in first:
            out[f"first_{k}"] = float(first[k])
    return out


def export_policy(graphdef, state, tokenizer, out_dir: str, *, adapters: bool = False,
                  base_source: Optional[str] = None) -> Optional[str]:
    """The policy in Hugging Face format, written by process 0 (every process must call it:
    with several, the parameters are gathered first); returns the folder (None elsewhere).
    `adapters`: its LoRA adapters also go to out_dir/adapters in PEFT's format, for the base
    model `base_source` (the load_pretrained source the adapters were trained on)."""
    from steprl_jax.models import export_hf

    params, rest = (state.params, state.rest) if jax.process_count() == 1 else \
        distributed.host_copy((state.params, state.rest))
    require_finite_params(params, out_dir)
    out = None
    if distributed.is_primary():  # LoRA adapters merged into the weights (and, with `adapters`, kept apart too)
        out = export_hf(merge_model(graphdef, params, rest), tokenizer, out_dir, overwrite=True, adapters=adapters,
                        base_source=base_source)
    distributed.barrier(f"exported {out_dir}")
    return out


@jax.jit
def _leaves_finite(params):
    return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True,
                        params)


def require_finite_params(params, out_dir: str) -> None:
    """`NonFiniteError` naming the first parameter that holds a NaN or an infinity: such a policy
    is never exported."""
    if all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
        finite = jax.device_get(_leaves_finite(params))
    else:  # host copies
        finite = jax.tree.map(lambda x: not jnp.issubdtype(x.dtype, jnp.inexact) or bool(np.all(np.isfinite(x))),
                              params)
    for path, ok in jax.tree_util.tree_flatten_with_path(finite)[0]:
        if not ok:
            raise NonFiniteError(f"{out_dir}: not exported: parameter {jax.tree_util.keystr(path)} holds NaN or "
                                 "infinite values. Lower the learning rate (optimizer.learning_rate) and train again "
                                 "from an earlier checkpoint")
