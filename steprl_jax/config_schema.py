"""The config schema: every field a job reads, with its type, range or choices, checked before a job runs.

    from steprl_jax import config_schema
    config_schema.check(config)   # None, or errors.ConfigError with one line naming the field

FIELDS maps each field's path to a `Field`: its kind (int, number, bool, str, csv, names, ints,
mapping), what values it allows, the jobs that read it, and whether a job may leave it out (the
code has a default). `check` refuses, in this order:

* an unknown `config.job`;
* a field FIELDS does not know (a typo, or a new field that needs its line here);
* a field the job reads and needs that the config lacks (named at its missing section);
* a value of another type, out of range, not a choice, or not finite: NaN and inf never pass;
* a switch the job does not read, turned on (e.g. rollout.tree.enabled with job swirl);
* more tasks than the task set holds (a file's records; the generated sets' cap).

A value of 0 (or -1) that stands for something ("0: no cap") says so in its field's `note`; every
other value out of range is an error, never a default. Checks that weigh several fields of one job
stay with that job (online.read_settings, each method's `read` (dapo.read, ...), swirl's _check_config and _stages, the
mesh sizes in training/distributed.py, a task file's contents in agents/tasks.py and data/).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Optional

from steprl_jax.errors import ConfigError
from steprl_jax.tools.world.tools import TOOL_NAMES as TOOL_WORLD_TOOLS

JOBS = ("evaluate", "swirl", "rl")  # main.JOBS
EXAMPLES = {"evaluate": "configs/demo.py is an evaluate config",
            "swirl": "configs/swirl_arithmetic.py is a swirl config",
            "rl": "configs/portool_toolworld.py is an rl config"}
EVALUATE, SWIRL, RL = ("evaluate",), ("swirl",), ("rl",)
TRAINING = ("swirl", "rl")


@dataclasses.dataclass(frozen=True)
class Field:
    kind: str  # int | number | bool | str | csv (comma-separated names) | names | ints | mapping
    lo: Optional[float] = None  # the least value (numbers; the members of ints)
    hi: Optional[float] = None  # the greatest value
    open_lo: bool = False  # lo itself is not allowed
    open_hi: bool = False  # hi itself is not allowed
    choices: tuple = ()  # str: the values allowed; csv, names: the names allowed
    special: tuple = ()  # values allowed besides the range or choices, each explained in `note`
    note: str = ""  # what a special or zero value means
    nonempty: bool = False  # str, csv, names: "" or () is not allowed
    jobs: tuple = JOBS  # the jobs that read the field
    optional: bool = False  # a job may leave it out: the code has a default
    # {job: why that job does not read the field}: there the field must stay at `off`
    ignored_by: tuple = ()
    off: Any = None


def integer(lo=None, hi=None, **kw) -> Field:
    return Field("int", lo=lo, hi=hi, **kw)


def number(lo=None, hi=None, **kw) -> Field:
    return Field("number", lo=lo, hi=hi, **kw)


def positive(**kw) -> Field:  # a finite number > 0
    return Field("number", lo=0, open_lo=True, **kw)


def probability(**kw) -> Field:
    return Field("number", lo=0, hi=1, **kw)


def flag(**kw) -> Field:
    return Field("bool", **kw)


def text(*choices, **kw) -> Field:
    return Field("str", choices=choices, **kw)


def names(*choices, **kw) -> Field:
    return Field("names", choices=choices, **kw)


DTYPES = ("float32", "bfloat16")
# Rematerialisation policies (models.transformer.remat_policy): ours and jax.checkpoint_policies'
# usual ones; "none" keeps every activation.
REMAT_POLICIES = ("qkvo_saveable", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "everything_saveable", "none")
# models.config.ATTENTION_IMPLEMENTATIONS (not imported: checking a config starts no JAX)
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "tpu", "tpu_interpret", "gpu")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "query_token_mean")  # algorithms/tree_rows.py
EPS_LOW = dict(lo=0, hi=1, open_hi=True)  # the PPO clip range below 1 (training/config.py LossConfig)
DDOF = dict(lo=0, hi=1, note="the z-score's std: 0 population, 1 sample")


def _judge_fields(prefix: str, jobs: tuple, rule_keys: bool, kinds: tuple = ("rule", "local", "http"),
                 note: str = "") -> dict:
    """A model judge's or reward model's settings: what judges/factory.py (and judges/rewards.py)
    accept. Empty strings mean "not set", as there."""
    unset = dict(jobs=jobs, optional=True)
    fields = {
        "kind": text(*kinds, jobs=jobs, **({"note": note} if note else {})),
        "base_url": text(**unset), "model": text(**unset), "api_key_env": text(**unset),
        "cache_dir": text(**unset),
        "votes": integer(1, note="a majority of this many replies", **unset),
        "temperature": number(0, note="0: greedy", **unset),
        "max_tokens": integer(1, **unset), "max_workers": integer(1, **unset),
        "max_context_chars": integer(1, **unset),
        "timeout_s": positive(**unset), "retries": integer(0, **unset),
        "backoff_s": number(0, **unset), "max_backoff_s": number(0, **unset),
        "max_concurrency": integer(1, **unset), "max_n_per_request": integer(1, **unset),
        "extra_body": Field("mapping", **unset),
        # a local judge's own model (default: the policy)
        "compute_dtype": text(*DTYPES, special=("",), note="'': the model's own", **unset),
        "max_context": integer(1, **unset), "seed": integer(0, **unset),
    }
    if rule_keys:
        fields.update({"rule": text("gsm8k", "hotpotqa", "toolworld", "math_verify", **unset),
                       "partial_f1": probability(note="0: off", **unset), "rel_tol": number(0, **unset)})
    return {f"{prefix}.{k}": v for k, v in fields.items()}


def _micro_batching(prefix: str, jobs: tuple) -> dict:
    """How a training stage splits a batch into micro-batches (the same gradient either way)."""
    return {f"{prefix}.num_microbatches": integer(1, jobs=jobs),
            f"{prefix}.max_microbatch_tokens": integer(0, jobs=jobs, note="0: exactly num_microbatches"),
            f"{prefix}.remat": text(*REMAT_POLICIES, jobs=jobs, optional=True,
                                    note="what the backward pass keeps; default qkvo_saveable")}


# ----------------------------------------------------------------------------- the table
# Shared sections first, then each job's own: a config that lacks a job's sections is told the
# first of them (config.swirl, config.rl) before the fields they hold.
FIELDS: dict[str, Field] = {
    "job": text(*JOBS, optional=True),  # default evaluate
    "workdir": text(nonempty=True),
    "seed": integer(0),
    "progress": flag(),

    "model.source": text(nonempty=True),
    "model.compute_dtype": text(*DTYPES),
    "model.attention": text(*ATTENTION_IMPLEMENTATIONS, optional=True,
                            note="auto: fused kernels on TPU/GPU, xla on CPU"),

    "task.name": text("arithmetic", "gsm8k", "hotpotqa", "toolworld"),
    "task.path": text(note="a JSONL file (gsm8k, hotpotqa)"),
    # swirl and rl pick the split themselves (train; test from the task.eval_* fields)
    "task.split": text("train", "test", "test_held_out", jobs=EVALUATE),
    "task.num_tasks": integer(1),
    "task.offset": integer(0),
    "task.seed": integer(0, optional=True, note="the generated tasks' seed (arithmetic, toolworld), not the run's"),
    "task.splits": flag(optional=True),  # arithmetic: disjoint built-in train / test splits
    "task.eval_path": text(jobs=TRAINING, optional=True, note="'': task.path"),
    "task.eval_offset": integer(0, jobs=TRAINING, optional=True),
    "task.eval_num_tasks": integer(1, jobs=SWIRL, optional=True),  # rl: rl.eval.num_tasks
    "task.world_seed": integer(0, optional=True),  # toolworld
    "task.failure_rate": probability(optional=True),  # toolworld: service tools that fail
    "task.latency_min_s": number(0, optional=True),  # toolworld: each call's duration, drawn from
    "task.latency_max_s": number(0, optional=True),  # [min, max]
    "task.corpus_path": text(optional=True, note="'': task.path"),  # hotpotqa
    "task.search_top_k": integer(1, optional=True),  # hotpotqa

    "env.format": text("tags", "tool_call", "code", "code_turns", "flow"),
    "env.tools": names("calculator", "search", "python", *TOOL_WORLD_TOOLS,
                       note="the tag format's tools; the code, code_turns and flow formats' python; the "
                            "tool world's offered tools (empty: all)"),
    # the code formats (agents/code_env.py): runs per response (code), and the Python sandbox's limits
    "env.max_tool_calls": integer(0, optional=True, note="0: no code runs"),
    "env.python.wall_timeout_s": positive(optional=True),
    "env.python.cpu_s": integer(1, optional=True),
    "env.python.memory_bytes": integer(1, optional=True),
    "env.python.stdout_chars": integer(1, optional=True),
    "env.python.max_concurrent": integer(1, optional=True, note="sandboxes running at once"),
    "env.python.queue_timeout_s": positive(optional=True),
    "env.invalid_action": text("error_observation", "end"),
    "env.few_shot": integer(0, note="0: no worked examples"),
    "env.tool_rendering": text("json", "compact", optional=True),  # models/chat.py TOOL_RENDERINGS

    "rollout.episodes_per_task": integer(1, jobs=EVALUATE),  # swirl: eval.*, rl: rl.eval.*
    "rollout.max_steps": integer(1),
    "rollout.max_new_tokens": integer(1),
    "rollout.max_context": integer(1),
    "rollout.batch_size": integer(1),
    "rollout.temperature": number(0, note="0: greedy"),
    "rollout.top_k": integer(0, note="0: off"),
    "rollout.top_p": number(0, 1, open_lo=True, note="1: off"),
    "rollout.tool_workers": integer(1),
    "rollout.tool_timeout_s": positive(),
    "rollout.max_result_chars": integer(1, optional=True),
    "rollout.continuous": flag(optional=True),
    "rollout.decode_chunk": integer(1, optional=True),
    "rollout.deterministic": flag(optional=True),
    # The rl job takes its rollout from config.algorithm (it never reads `enabled`; the portool
    # config keeps it on for --config.job=evaluate); SWiRL samples episodes only.
    "rollout.tree.enabled": flag(jobs=EVALUATE, ignored_by=(("swirl", "SWiRL never samples trees"),), off=False),
    "rollout.tree.n": integer(1, jobs=("evaluate", "rl"), note="trajectories per query"),
    "rollout.tree.f": integer(2, jobs=("evaluate", "rl"), note="the branching factor"),
    "rollout.tree.schedule": text("static", "resample", jobs=("evaluate", "rl")),
    "rollout.tree.fork_depths": Field("ints", lo=1, jobs=("evaluate", "rl")),

    **_judge_fields("judge.outcome", JOBS, rule_keys=True),
    **_judge_fields("judge.process", JOBS, rule_keys=True, kinds=("rule", "local", "http", "reference"),
                    note="reference: the math tasks' reference-guided step judge; it sees the golden "
                         "solution, for experiments only"),
    "judge.cache_dir": text(note="'': <workdir>/judge_cache"),
    "judge.partial_f1": probability(optional=True, note="0: off"),  # hotpotqa's outcome rule

    # Devices (training/distributed.py): the sizes' product is checked against the devices there.
    **{f"mesh.{p}{axis}": integer(1, special=(-1,), optional=True, note="-1: the devices left over")
       for p in ("", "sampler.") for axis in ("data", "fsdp", "tensor")},
    "distributed.mode": text("off", "auto", "on", optional=True),
    "distributed.coordinator_address": text(optional=True, note="'': JAX_COORDINATOR_ADDRESS"),
    "distributed.num_processes": integer(0, optional=True, note="0: JAX_NUM_PROCESSES"),
    "distributed.process_id": integer(0, special=(-1,), optional=True, note="-1: JAX_PROCESS_ID"),
    "distributed.initialization_timeout_s": integer(1, optional=True),
    "distributed.heartbeat_timeout_s": integer(1, optional=True),
    "distributed.shutdown_timeout_s": integer(1, optional=True),

    # Only the training jobs read lora; evaluate loads the policy as it is.
    "lora.rank": integer(0, jobs=TRAINING, optional=True, note="0: no adapters, every weight trains",
                         ignored_by=(("evaluate", "it trains nothing"),), off=0),
    "lora.alpha": positive(jobs=TRAINING, optional=True),
    "lora.targets": names("q", "k", "v", "o", "gate", "up", "down", nonempty=True, jobs=TRAINING, optional=True),
    "lora.export_adapters": flag(jobs=TRAINING, optional=True,
                                 ignored_by=(("evaluate", "it trains nothing"),), off=False),

    # SWiRL (algorithms/swirl.py)
    "swirl.samples_per_question": integer(1, jobs=SWIRL),
    "swirl.filter": text("none", "process", "outcome", "process_outcome", jobs=SWIRL),
    "swirl.granularity": text("trajectory", "step", jobs=SWIRL),
    "swirl.drop_easy": flag(jobs=SWIRL),
    "swirl.train.group_size": integer(1, jobs=SWIRL),
    "swirl.train.batch_size": integer(1, jobs=SWIRL),
    "swirl.train.updates": integer(1, jobs=SWIRL),
    "swirl.train.ppo_epochs": integer(1, jobs=SWIRL),
    "swirl.train.minibatches": integer(1, jobs=SWIRL),
    **_micro_batching("swirl.train", SWIRL),
    "swirl.train.advantage": text("rloo", "zscore", jobs=SWIRL),
    "swirl.train.scale_by_std": flag(jobs=SWIRL),
    "swirl.train.agg": text("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                            jobs=SWIRL),  # ops/losses.py AGG_MODES
    "swirl.train.eps_low": number(**EPS_LOW, jobs=SWIRL),
    "swirl.train.eps_high": number(0, jobs=SWIRL),
    "swirl.train.kl_coef": number(0, jobs=SWIRL, note="0: no KL"),
    "swirl.train.save_every": integer(1, jobs=SWIRL),
    "swirl.sft.epochs": integer(1, jobs=SWIRL),
    "swirl.sft.batch_size": integer(1, jobs=SWIRL),
    **_micro_batching("swirl.sft", SWIRL),
    "judge.batch_size": integer(1, jobs=SWIRL),
    "stages": Field("csv", choices=("collect", "judge", "filter", "train", "sft", "eval"), nonempty=True, jobs=SWIRL),
    **_judge_fields("reward", SWIRL, rule_keys=False),
    "reward.scale": text("binary", "graded", jobs=SWIRL),
    "eval.temperature": number(0, jobs=SWIRL, note="0: greedy"),
    "eval.episodes_per_task": integer(1, jobs=SWIRL),

    # Online RL (algorithms/online.py and one block per method)
    "rl.iterations": integer(0, jobs=RL, note="0: the warm start only"),
    "rl.queries_per_iteration": integer(1, jobs=RL),
    "rl.ppo_epochs": integer(1, jobs=RL),
    "rl.minibatches": integer(1, jobs=RL),
    **_micro_batching("rl", RL),
    "rl.save_every": integer(1, jobs=RL),
    "rl.eval_every": integer(1, jobs=RL),
    "rl.max_row_tokens": integer(0, jobs=RL, note="0: no cap"),
    "rl.skip_update_without_signal": flag(jobs=RL),
    "rl.attention_length": number(0, jobs=RL, note="0: keep the rows as built"),
    "rl.gamma": number(0, 1, open_lo=True, jobs=RL),
    "rl.fm_scale": number(0, jobs=RL),
    "rl.asynchronous.max_staleness": integer(0, jobs=RL, note="0: the synchronous loop"),
    "rl.asynchronous.in_flight": flag(jobs=RL),
    "rl.asynchronous.is_cap": number(0, jobs=RL, note="0: no off-policy correction"),
    "rl.eval.num_tasks": integer(0, jobs=RL, note="0: no evaluation"),
    "rl.eval.episodes_per_task": integer(1, jobs=RL),
    "rl.eval.temperature": number(0, jobs=RL, note="0: greedy"),
    "rl.eval.votes": integer(1, jobs=RL),
    "rl.warm_start.source": text(jobs=RL, note="'': train the warm start here"),
    "rl.warm_start.updates": integer(0, jobs=RL, note="0: no warm start"),
    "rl.warm_start.batch_size": integer(1, jobs=RL),
    "rl.warm_start.learning_rate": positive(jobs=RL),
    **_micro_batching("rl.warm_start", RL),
    "rl.warm_start.max_row_tokens": integer(0, jobs=RL, note="0: no cap"),
    "rl.warm_start.save_every": integer(1, jobs=RL),
    "rl.portool.w1": number(0, jobs=RL),
    "rl.portool.w2": number(0, jobs=RL),
    "rl.portool.rescale_fork_weight": flag(jobs=RL),
    "rl.portool.ddof": integer(**DDOF, jobs=RL),
    "rl.portool.discount_failures": flag(jobs=RL),
    "rl.portool.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.portool.eps_high": number(0, jobs=RL),
    "rl.portool.agg": text(*LOSS_AGGS, jobs=RL),
    "rl.portool.token_weighting": text("per_trajectory", "once", jobs=RL),
    "rl.grpo.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.grpo.eps_high": number(0, jobs=RL),
    "rl.grpo.kl_coef": number(0, jobs=RL, optional=True, note="0: no KL"),
    "rl.grpo.agg": text(*LOSS_AGGS, jobs=RL),
    "rl.grpo.ddof": integer(**DDOF, jobs=RL),
    "rl.dapo.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.dapo.eps_high": number(0, jobs=RL),
    "rl.dapo.agg": text(*LOSS_AGGS, jobs=RL),
    "rl.dapo.ddof": integer(**DDOF, jobs=RL),
    "rl.dapo.overlong_cache": integer(1, jobs=RL),  # dapo.read: at most the response length
    # dapo.read: at most rollout.max_context
    "rl.dapo.max_response_tokens": integer(0, jobs=RL, note="0: rollout.max_context minus the prompt"),
    "rl.dapo.max_sampling_rounds": integer(1, jobs=RL),
    "rl.arpo.initial": integer(1, jobs=RL),
    "rl.arpo.alpha": probability(jobs=RL),
    "rl.arpo.beta": number(jobs=RL),  # p = clip(alpha + beta * dH, 0, 1): any finite weight
    "rl.arpo.entropy_tokens": integer(1, jobs=RL),
    "rl.gigpo.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.gigpo.eps_high": number(0, jobs=RL),
    "rl.gigpo.kl_coef": number(0, jobs=RL, note="0: no KL"),
    "rl.gigpo.agg": text(*LOSS_AGGS, jobs=RL),
    "rl.gigpo.ddof": integer(**DDOF, jobs=RL),
    "rl.gigpo.gamma": probability(jobs=RL),
    "rl.gigpo.step_weight": number(0, jobs=RL),
    "rl.gigpo.mode": text("mean_std_norm", "mean_norm", jobs=RL),
    "rl.gigpo.episode_stats": text("steps", "trajectories", jobs=RL),
    "rl.gigpo.state_key": text("observation", "history", jobs=RL),
    "rl.gigpo.invalid_penalty": number(0, jobs=RL, note="0: no penalty"),
    "rl.tree_grpo.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.tree_grpo.eps_high": number(0, jobs=RL),
    "rl.tree_grpo.kl_coef": number(0, jobs=RL, note="0: no KL"),
    "rl.tree_grpo.agg": text(*LOSS_AGGS, jobs=RL),
    "rl.tree_grpo.ddof": integer(**DDOF, jobs=RL),
    "rl.tree_grpo.m": integer(1, jobs=RL),
    "rl.tree_grpo.n": integer(1, jobs=RL),
    "rl.tree_grpo.rounds": integer(0, jobs=RL),
    "rl.tree_grpo.keep": integer(1, jobs=RL),  # tree_grpo.read: at most 1 + n * rounds
    "rl.tree_grpo.combine": text("sum", "nested", "intra", "inter", jobs=RL),
    "rl.torl.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.torl.eps_high": number(0, jobs=RL),
    "rl.torl.agg": text(*LOSS_AGGS, jobs=RL),
    "rl.torl.ddof": integer(**DDOF, jobs=RL),
    "rl.simpletir.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.simpletir.eps_high": number(0, jobs=RL),
    "rl.simpletir.dual_clip": Field("number", lo=1, open_lo=True, jobs=RL),  # a cap on -A, c > 1
    "rl.simpletir.agg": text(*LOSS_AGGS, jobs=RL),
    "rl.simpletir.ddof": integer(**DDOF, jobs=RL),
    "rl.simpletir.mask_void_turns": flag(jobs=RL),
    "rl.simpletir.min_std": number(0, jobs=RL),
    "rl.simpletir.max_sampling_rounds": integer(1, jobs=RL),
    "rl.flow_grpo.max_turns": integer(1, jobs=RL),
    "rl.flow_grpo.normalize": text("rollout", "row", jobs=RL),
    "rl.flow_grpo.eps_low": number(**EPS_LOW, jobs=RL),
    "rl.flow_grpo.eps_high": number(0, jobs=RL),
    "rl.flow_grpo.kl_coef": number(0, jobs=RL, note="0: no KL"),
    "rl.flow_grpo.ddof": integer(**DDOF, jobs=RL),
    "rl.flow_grpo.memory_chars": integer(16, jobs=RL),
    "rl.flow_grpo.tools": names("Python_Coder_Tool", "Base_Generator_Tool", nonempty=True, jobs=RL),
    "rl.flow_grpo.frozen.kind": text("base", "http", jobs=RL),
    "rl.flow_grpo.frozen.base_url": text(jobs=RL, note="'': needed only by kind http"),
    "rl.flow_grpo.frozen.model": text(jobs=RL, note="'': needed only by kind http"),
    "rl.flow_grpo.frozen.api_key_env": text(jobs=RL, note="'': no key"),
    "rl.flow_grpo.frozen.timeout_s": positive(jobs=RL),
    "rl.flow_grpo.frozen.temperature": number(0, 2, jobs=RL, note="0: greedy"),
    "rl.flow_grpo.frozen.max_tokens": integer(1, jobs=RL),
    "algorithm": text("portool", "grpo", "grpo_fm", "dapo", "arpo", "arpo_fm", "gigpo", "tree_grpo", "torl",
                      "simpletir", "flow_grpo", jobs=RL),  # algorithms/base.py ALGORITHMS

    # both training jobs (algorithms/offline.py optimizer_config)
    "optimizer.learning_rate": positive(jobs=TRAINING),
    "optimizer.warmup_steps": integer(0, jobs=TRAINING),
    "optimizer.end_lr_ratio": probability(jobs=TRAINING),
    "optimizer.weight_decay": number(0, jobs=TRAINING),
    "optimizer.max_grad_norm": number(0, jobs=TRAINING, note="0: no clipping"),
}

SECTIONS = {path.rsplit(".", i)[0] for path in FIELDS for i in range(1, path.count(".") + 1)}


# ----------------------------------------------------------------------------- checking
def check(config) -> None:
    """Refuse a config whose fields do not fit FIELDS for its job: a ConfigError naming the field."""
    job = config.get("job", "evaluate")
    if job not in JOBS:
        raise ConfigError(f"config.job: unknown job {job!r}; valid jobs: {', '.join(sorted(JOBS))}")
    leaves = list(_leaves(config))
    for path, value in leaves:
        if path not in FIELDS:
            raise ConfigError(_unknown(path, value))
    for path, field in FIELDS.items():
        if job in field.jobs and not field.optional and _lookup(config, path) is _MISSING:
            raise ConfigError(f"config.{_missing_prefix(config, path)}: missing; the {job} job needs it "
                              f"({EXAMPLES[job]})")
    for path, value in leaves:
        field = FIELDS[path]
        if not _valid(field, value):
            raise ConfigError(f"config.{path}: {_show(value)} is not allowed ({allowed(field)})")
        reason = dict(field.ignored_by).get(job)
        if reason and value != field.off:
            raise ConfigError(f"config.{path}: {value!r} is not allowed with job {job} (the {job} job does not read "
                              f"it: {reason}; leave it {field.off!r})")
    _check_model_judges(config, job)
    _check_task_counts(config, job)


JUDGE_SECTIONS = {"judge.outcome": "outcome judge", "judge.process": "process judge", "reward": "reward model"}


def _check_model_judges(config, job: str) -> None:
    """A judge or reward model the job uses that asks a server needs to know which, and where."""
    for section, role in JUDGE_SECTIONS.items():
        if job not in FIELDS[f"{section}.kind"].jobs or _value(config, f"{section}.kind", "rule") != "http":
            continue
        for name in ("base_url", "model"):
            if not _value(config, f"{section}.{name}", ""):
                raise ConfigError(f"config.{section}.{name}: empty; an http {role} needs base_url "
                                  "(e.g. http://127.0.0.1:8000/v1) and model")


def allowed(field: Field) -> str:
    """What `field` allows, in words: "an integer >= 1", "one of rloo, zscore", ..."""
    kind = field.kind
    if kind == "bool":
        return "True or False"
    if kind == "mapping":
        return "a mapping"
    if kind in ("str", "csv", "names"):
        listed = ", ".join(field.choices)
        words = {"str": f"one of {listed}" if field.choices else "a string",
                 "csv": f"a comma-separated list of {listed}",
                 "names": f"a tuple of distinct names from {listed}"}[kind]
        if field.nonempty:
            words += " (at least one)" if kind != "str" else ", not empty"
    else:
        what = {"int": "an integer", "number": "a finite number", "ints": "a tuple of integers"}[kind]
        words = f"{what} {_range(field)}".rstrip()
    if field.special:
        words = f"{' or '.join(repr(s) for s in field.special)} or {words}"
    return f"{words}; {field.note}" if field.note else words


def _range(field: Field) -> str:
    lo, hi = field.lo, field.hi
    if lo is not None and hi is not None:
        return f"in {'(' if field.open_lo else '['}{lo:g}, {hi:g}{')' if field.open_hi else ']'}"
    if lo is not None:
        return f"{'>' if field.open_lo else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if field.open_hi else '<='} {hi:g}"
    return ""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _in_range(field: Field, value) -> bool:
    if field.lo is not None and (value <= field.lo if field.open_lo else value < field.lo):
        return False
    return field.hi is None or (value < field.hi if field.open_hi else value <= field.hi)


def _valid(field: Field, value) -> bool:
    kind = field.kind
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return _is_int(value) and (value in field.special or _in_range(field, value))
    if kind == "number":
        return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
                and (value in field.special or _in_range(field, value)))
    if kind == "str":
        return isinstance(value, str) and (value in field.special or (
            value in field.choices if field.choices else bool(value) or not field.nonempty))
    if kind == "csv":
        items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else None
        return items is not None and all(s in field.choices for s in items) and (bool(items) or not field.nonempty)
    if kind == "names":
        return (isinstance(value, (tuple, list)) and all(isinstance(v, str) and v in field.choices for v in value)
                and len(set(value)) == len(value) and (bool(value) or not field.nonempty))
    if kind == "ints":
        return isinstance(value, (tuple, list)) and all(_is_int(v) and _in_range(field, v) for v in value)
    if kind == "mapping":
        return _is_section(value)
    raise ValueError(f"unknown field kind {kind!r}")


def _show(value) -> str:
    """A value as the message shows it, on one line (a ConfigDict's repr takes several)."""
    return "a section" if _is_section(value) else repr(value)


def _is_section(value) -> bool:
    return hasattr(value, "items") and hasattr(value, "get")  # ConfigDict or dict


def _leaves(config, prefix: str = ""):
    """(path, value) of every field that is not a section (a mapping field is a leaf)."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if _is_section(value) and path in SECTIONS:
            yield from _leaves(value, path + ".")
        else:  # a field, or a section the table does not know
            yield path, value


_MISSING = object()


def _lookup(config, path: str):
    node = config
    for part in path.split("."):
        if not _is_section(node) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _value(config, path: str, default):
    value = _lookup(config, path)
    return default if value is _MISSING else value


def _missing_prefix(config, path: str) -> str:
    """The shortest prefix of `path` the config lacks: the section, when the whole section is missing."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        if _lookup(config, ".".join(parts[:i])) is _MISSING:
            return ".".join(parts[:i])
    return path


def _unknown(path: str, value) -> str:
    if path in SECTIONS:
        inside = sorted(p[len(path) + 1:].split(".")[0] for p in FIELDS if p.startswith(path + "."))
        return f"config.{path}: {_show(value)} is not allowed (a section of {', '.join(dict.fromkeys(inside))})"
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    known = sorted({p[len(parent) + 1 if parent else 0:].split(".")[0] for p in FIELDS
                    if not parent or p.startswith(parent + ".")})
    where = f"config.{parent}" if parent else "config"
    return f"config.{path}: unknown field (not in steprl_jax/config_schema.py; {where} holds {', '.join(known)})"


def _check_task_counts(config, job: str) -> None:
    """task.offset + task.num_tasks (and the held-out window) within the task set: a generated set
    up to agents.tasks.MAX_GENERATED_TASKS, a file up to its records. Checked here too, before a
    job records the count in its workdir's manifest (agents/tasks.py checks where it builds)."""
    from steprl_jax.agents.tasks import MAX_GENERATED_TASKS

    task = config["task"]
    windows = [(task["path"], "task.offset", "task.num_tasks")]
    held_out = task.get("eval_path") or task["path"]
    if "eval_path" in task and job == "swirl":
        windows.append((held_out, "task.eval_offset", "task.eval_num_tasks"))
    if "eval_path" in task and job == "rl" and _value(config, "rl.eval.num_tasks", 0) > 0:
        windows.append((held_out, "task.eval_offset", "rl.eval.num_tasks"))
    for path, offset_path, count_path in windows:
        offset, count = _value(config, offset_path, 0), _value(config, count_path, 0)
        if task["name"] in ("arithmetic", "toolworld"):
            limit, source = MAX_GENERATED_TASKS, f"the {task['name']} tasks are generated"
        elif path and os.path.isfile(path):
            limit, source = _records(path), f"the tasks in {path}"
        elif path:
            field = "task.eval_path" if path == task.get("eval_path") else "task.path"
            raise ConfigError(f"config.{field}: {path} is not a file")
        else:
            continue
        if offset + count > limit:
            raise ConfigError(f"config.{count_path}: {count} is not allowed ({offset_path} + {count_path} at most "
                              f"{limit}: {source})")


def _records(path: str) -> int:
    """The records of a JSONL file: its lines that are not blank."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())
