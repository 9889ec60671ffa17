"""The one offline loop: saved items (units, trajectories) -> batches -> train steps -> checkpoints.

    learner = train_offline(spec, model, workdir=..., seed=...)   # training/learner.py

`spec.build(items, update, policy)` turns the update's items into packed rows (SWiRL stage 2
samples fresh actions from `policy`, the current parameters; SFT ignores it) and returns
(rows, metrics). Each update runs `ppo_epochs` passes of `minibatches` train steps over its batch.

Resume. An orbax checkpoint every `save_every` updates holds the train state (parameters,
optimizer, step, its RNG key) and the data position (the next update); the item order is a
permutation per epoch from the seed, and every sampling key is `fold_in(seed key, update)`, so
a resumed run continues bit-identically. The policy is exported (Hugging Face format) at the end.

A train step whose loss, gradient norm or learning rate is not finite stops the run with a
`NonFiniteError` (training/learner.py) before anything more is saved.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from tqdm import tqdm

from steprl_jax.models.lora import LoraConfig
from steprl_jax.training import OptimizerConfig, distributed
from steprl_jax.training.host_memory import trim_heap
from steprl_jax.training.learner import Learner, LearnerSettings
from steprl_jax.training.metrics_log import MetricsLog

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class OfflineSpec:
    name: str  # checkpoint folder, metrics stage and export folder
    items: Sequence[Any]
    build: Callable  # (items, update, policy) -> (rows, metrics dict)
    learner: LearnerSettings  # loss, optimizer, micro-batches, epochs, ... (training/learner.py)
    batch_size: int
    updates: int
    save_every: int = 10
    needs_policy: bool = False  # build samples from the current parameters (a copy: the step donates them)


def remat_of(section) -> Optional[str]:
    """A training section's `remat` (default "qkvo_saveable"; "none": keep every activation)."""
    name = section.get("remat", "qkvo_saveable") or "qkvo_saveable"
    return None if name == "none" else name


def items_at(items: Sequence[Any], start: int, count: int, seed: int) -> list:
    """Items `start .. start + count - 1` of the stream of per-epoch permutations of `items` (a
    fixed function of the seed, so a resumed run sees the same items)."""
    n = len(items)
    orders: dict = {}
    out = []
    for k in range(start, start + count):
        epoch, pos = divmod(k, n)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(items[int(orders[epoch][pos])])
    return out


def batch_items(items: Sequence[Any], batch_size: int, update: int, seed: int) -> list:
    """The items of `update`: consecutive slices of the per-epoch permutations."""
    return items_at(items, update * batch_size, batch_size, seed)


def optimizer_config(config, total_steps: int, learning_rate: Optional[float] = None) -> OptimizerConfig:
    """`config.optimizer` for a run of `total_steps` train steps (warm-up capped to fit);
    `learning_rate` overrides its learning rate (e.g. the SFT warm start's)."""
    o = config.optimizer
    lr = float(o.learning_rate if learning_rate is None else learning_rate)
    return OptimizerConfig(learning_rate=lr, warmup_steps=min(int(o.warmup_steps), max(0, total_steps - 1)),
                           total_steps=max(1, total_steps), end_lr_ratio=float(o.end_lr_ratio),
                           weight_decay=float(o.weight_decay), max_grad_norm=float(o.max_grad_norm) or None)


def update_key(seed: int, update: int):
    return jax.random.fold_in(jax.random.PRNGKey(seed), update)


def lora_fields(config) -> dict:
    """config.lora as manifest fields: a checkpoint's tree depends on them."""
    c = LoraConfig.from_config(config.get("lora"))
    return {"lora": None if c is None else {"rank": c.rank, "alpha": c.alpha, "targets": list(c.targets)}}


def export_adapters(config) -> bool:
    """config.lora.export_adapters: export_policy also writes the LoRA adapters in PEFT's format."""
    c = config.get("lora")
    return LoraConfig.from_config(c) is not None and bool(c.get("export_adapters", False))


def train_offline(spec: OfflineSpec, model, *, workdir: str, seed: int, progress: bool = True,
                  base_source: Optional[str] = None, mesh: Optional[distributed.MeshSpec] = None) -> Learner:
    """Run (or resume) `spec`; returns the learner (its final train state, `export`). With `base_source`
    (the load_pretrained source of `model`) the checkpoint folder loads as a policy itself.
    `mesh` (config.mesh): the trainer's mesh, and where each process's policy copy for
    `spec.build` lives (training/distributed.py); every process builds the same global batch."""
    if not spec.items:
        raise ValueError(f"{spec.name}: no training items (did the filter keep anything?)")
    learner = Learner(model, spec.learner, seed=seed, checkpoint_dir=os.path.join(workdir, "checkpoints", spec.name),
                      mesh=mesh, base_source=base_source)
    position = learner.restore()
    start = 0 if position is None else int(position["update"])
    if start:
        log.info("%s: resumed at update %d (step %d)", spec.name, start, learner.step)
    metrics_log = MetricsLog(workdir, spec.name) if distributed.is_primary() else None
    bar = tqdm(total=spec.updates, initial=start, desc=spec.name, disable=not progress or not distributed.is_primary())
    try:
        for update in range(start, spec.updates):
            t0 = time.perf_counter()
            policy = learner.policy() if spec.needs_policy else None
            rows, metrics = spec.build(batch_items(spec.items, spec.batch_size, update, seed), update, policy)
            if not rows:
                log.warning("%s: update %d has no rows (every sample dropped); skipped", spec.name, update)
                metrics = {**metrics, "skipped": 1.0}
            else:
                metrics.update(learner.update(rows, where=f"{spec.name} update {update + 1}"),
                               update_s=time.perf_counter() - t0)
            trim_heap()  # the update's buffers back to the system (training/host_memory.py)
            if metrics_log is not None:
                metrics_log.write(update + 1, metrics)
            if (update + 1) % spec.save_every == 0 or update + 1 == spec.updates:
                learner.save(update + 1, {"update": update + 1})
            bar.update(1)
            bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward", "loss") if k in metrics})
    finally:
        bar.close()
        if metrics_log is not None:
            metrics_log.close()
        learner.close()
    return learner


