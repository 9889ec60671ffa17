"""The one train step every algorithm reuses.

    step_fn = make_train_step(graphdef, tx, TrainStepConfig(loss=LossConfig(...)), mesh=mesh,
                              state_shardings=shardings)
    state, metrics = step_fn(state, batch)          # batch: training.batch.Batch, [B, L]

Loss = (sum over micro-batches of the per-token loss sums) / (denominator of the WHOLE batch).
Denominators depend only on the mask, so they are computed once from the full batch and the
micro-batch loop only accumulates sums and gradient sums: accumulation over M micro-batches is
the same computation as one big batch for every aggregation mode, and data parallelism is the
same sum spread over devices (XLA inserts the all-reduce). The division happens once, at the
end; a zero denominator gives zero loss and zero gradient.

Micro-batch m takes rows m, m + M, m + 2M, ... so every micro-batch stays spread over all
data shards.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from steprl_jax.models.fused_attention import traced_under
from steprl_jax.models.sharding import LOGICAL_AXIS_RULES, batch_sharding
from steprl_jax.ops import losses
from steprl_jax.training.batch import Batch
from steprl_jax.training.config import LossConfig, TrainStepConfig
from steprl_jax.training.forward import sequence_logprobs
from steprl_jax.training.state import TrainState, merge_model


def loss_sums(model, batch: Batch, cfg: LossConfig, remat: Optional[str] = None):
    """(loss_sum, metric_sums) of one (micro-)batch; the caller divides by the denominator."""
    want_entropy = cfg.entropy_coef > 0
    # Column 0 has no prediction; force it out even if a builder forgot.
    mask_bt = batch.loss_mask.astype(jnp.float32).at[:, 0].set(0.0)
    # Log-probs only where the loss reads them (every term below is masked by mask_bt).
    out = sequence_logprobs(model, batch.tokens, attention_mask_bt=batch.attention_mask,
                            positions_bt=batch.positions, branch_ids_bt=batch.branch_ids,
                            branch_ends_bt=batch.branch_ends, key_blocks_bqm=batch.key_blocks,
                            temperature=cfg.temperature, chunk_size=cfg.logprob_chunk,
                            with_entropy=want_entropy, remat=remat, loss_mask_bt=mask_bt)
    logp_bt, entropy_bt = out if want_entropy else (out, None)
    on = (mask_bt > 0).astype(jnp.float32)  # metric sums count tokens; the loss uses the weights
    if cfg.kind == "sft":
        total = losses.agg_sum(-logp_bt, mask_bt, cfg.agg)
        metrics = {"token_count": jnp.sum(on),
                   "nll": jnp.sum(jnp.where(on > 0, jax.lax.stop_gradient(-logp_bt), 0.0))}
    else:
        old_logp, is_weight, is_sums = batch.old_logp, batch.is_weight, {}
        if cfg.proximal_cap is not None:  # this pass is the proximal policy; old_logp the behaviour's
            old_logp = jax.lax.stop_gradient(logp_bt)
            is_weight, is_sums = losses.truncated_is_weights(old_logp, batch.old_logp, mask_bt, cfg.proximal_cap)
            is_sums.pop("token_count")
        total, _, metrics = losses.policy_loss(
            logp_bt, old_logp, batch.advantages, mask_bt, eps_low=cfg.eps_low,
            eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, agg=cfg.agg, norm=cfg.norm, is_weight_bt=is_weight)
        metrics.update(is_sums)
    if cfg.kl_coef > 0:
        if batch.ref_logp is None:
            raise ValueError("kl_coef > 0 needs batch.ref_logp (see make_logprob_fn)")
        kl_bt = losses.KL_ESTIMATORS[cfg.kl_estimator](logp_bt, batch.ref_logp)
        total = total + cfg.kl_coef * losses.agg_sum(kl_bt, mask_bt, cfg.agg)
        metrics["kl"] = jnp.sum(jax.lax.stop_gradient(kl_bt) * on)
    if want_entropy:
        total = total - cfg.entropy_coef * losses.agg_sum(entropy_bt, mask_bt, cfg.agg)
        metrics["entropy"] = jnp.sum(jax.lax.stop_gradient(entropy_bt) * on)
    return total, metrics


def _split_microbatches(batch: Batch, m: int) -> Batch:
    def split(x):
        b = x.shape[0]
        if b % m:
            raise ValueError(f"batch of {b} rows does not split into {m} micro-batches")
        return jnp.swapaxes(x.reshape(b // m, m, *x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def microbatch_count(rows: int, length: int, *, num_microbatches: int = 1, max_tokens: int = 0,
                     data_shards: int = 1) -> int:
    """How many micro-batches a [rows, length] batch runs as: `num_microbatches`, or with
    `max_tokens` > 0 the fewest that divide each data shard's rows evenly, are at least
    `num_microbatches`, and hold at most `max_tokens` padded tokens per shard (one row per shard
    per micro-batch when even that is more)."""
    if max_tokens <= 0:
        return num_microbatches
    per_shard = rows // data_shards if rows % data_shards == 0 else rows
    for count in range(num_microbatches, per_shard + 1):
        if per_shard % count == 0 and (per_shard // count) * length <= max_tokens:
            return count
    return max(per_shard, num_microbatches)


def make_loss_and_grad(graphdef, cfg: TrainStepConfig, mesh: Optional[Mesh] = None,
                       rules: dict = LOGICAL_AXIS_RULES) -> Callable:
    """fn(params, rest, batch) -> (loss, grads, metric_sums), unjitted (for tests and reuse)."""
    lcfg = cfg.loss

    def micro(params, rest, mb):
        if mesh is not None:
            mb = jax.lax.with_sharding_constraint(mb, _batch_shardings(mb, mesh, rules))
        return loss_sums(merge_model(graphdef, params, rest), mb, lcfg, cfg.remat)

    grad_fn = jax.value_and_grad(micro, has_aux=True)

    shards = data_shards(mesh, rules)

    def fn(params, rest, batch: Batch):
        if lcfg.kl_coef > 0 and batch.ref_logp is None:
            raise ValueError("kl_coef > 0 needs batch.ref_logp (see make_logprob_fn)")
        mask = batch.loss_mask.astype(jnp.float32).at[:, 0].set(0.0)
        denom = losses.agg_denominator(mask, lcfg.agg, norm=lcfg.norm)
        count = microbatch_count(*batch.tokens.shape, num_microbatches=cfg.num_microbatches,
                                 max_tokens=cfg.max_microbatch_tokens, data_shards=shards)
        if count == 1:
            (total, metrics), grads = grad_fn(params, rest, batch)
        else:
            # One scan over every micro-batch, from the sums' identities: the program holds the
            # model's forward and backward once (the first micro-batch apart doubled the compile).
            mbs = _split_microbatches(batch, count)
            shapes = jax.eval_shape(grad_fn, params, rest, jax.tree.map(lambda x: x[0], mbs))
            (total, metrics), grads = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
            metrics = losses.empty_metrics(metrics)

            def body(carry, mb):
                t_acc, m_acc, g_acc = carry
                (t, m), g = grad_fn(params, rest, mb)
                return (t_acc + t, losses.combine_metrics(m_acc, m),
                        jax.tree.map(jnp.add, g_acc, g)), None

            (total, metrics, grads), _ = jax.lax.scan(body, (total, metrics, grads), mbs)
        scale = losses.safe_divide(jnp.float32(1.0), denom)
        grads = jax.tree.map(lambda g: g * scale, grads)
        return total * scale, grads, metrics

    return fn


def data_shards(mesh: Optional[Mesh], rules: dict = LOGICAL_AXIS_RULES) -> int:
    """How many ways a batch splits over `mesh`'s data axes (1 without a mesh)."""
    if mesh is None:
        return 1
    axes = batch_sharding(mesh, rules).spec[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(math.prod(mesh.shape[a] for a in axes))


def _batch_shardings(batch: Batch, mesh: Mesh, rules: dict):
    sh = batch_sharding(mesh, rules)
    return jax.tree.map(lambda _: sh, batch)


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: TrainStepConfig, *,
                    mesh: Optional[Mesh] = None, state_shardings: Optional[TrainState] = None,
                    rules: dict = LOGICAL_AXIS_RULES, schedule: Optional[Callable] = None):
    """The jitted `train_step(state, batch) -> (new_state, metrics)`; `state` is donated.

    With a mesh, `state_shardings` (from create_train_state) are the in/out shardings of the
    state, the batch is sharded over the data axes, metrics are replicated.
    """
    loss_and_grad = make_loss_and_grad(graphdef, cfg, mesh, rules)

    def step(state: TrainState, batch: Batch):
        loss, grads, msums = loss_and_grad(state.params, state.rest, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = losses.finalize_metrics(msums)
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  rng=jax.random.fold_in(state.rng, state.step))
        return new_state, metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=0)
    if state_shardings is None:
        raise ValueError("a mesh needs state_shardings (from create_train_state)")
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sh = batch_sharding(mesh, rules)
    return jax.jit(traced_under(mesh, step), in_shardings=(state_shardings, batch_sh),
                   out_shardings=(state_shardings, replicated), donate_argnums=0)


def make_logprob_fn(graphdef, *, temperature: float = 1.0, chunk_size: Optional[int] = None,
                    mesh: Optional[Mesh] = None, rules: dict = LOGICAL_AXIS_RULES):
    """Jitted fn(params, rest, tokens, attention_mask, loss_mask=None, positions=None,
    branch_ids=None, branch_ends=None, key_blocks=None) -> logp_bt [B, L],
    aligned like Batch: recompute old log-probs or fill `ref_logp` from a frozen reference
    model's params (`attention_mask` may be None; with `loss_mask` only the marked tokens are
    computed, the others read 0). Inputs keep the shardings they were placed with; with a
    mesh the output is sharded over the data axes like a Batch."""
    def fn(params, rest, tokens, attention_mask, loss_mask=None, positions=None, branch_ids=None,
           branch_ends=None, key_blocks=None):
        model = merge_model(graphdef, params, rest)
        return sequence_logprobs(model, tokens, attention_mask_bt=attention_mask,
                                 positions_bt=positions, branch_ids_bt=branch_ids, branch_ends_bt=branch_ends,
                                 key_blocks_bqm=key_blocks,
                                 temperature=temperature, chunk_size=chunk_size,
                                 loss_mask_bt=loss_mask)
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(traced_under(mesh, fn), out_shardings=batch_sharding(mesh, rules))
