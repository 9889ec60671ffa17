"""SWiRL end to end (METHODS 1): collect -> judge -> filter -> train (offline step-wise RL) -> sft -> eval.

    python -m steprl_jax.main --config=configs/swirl_arithmetic.py [--config.stages=collect,judge,...]

Every stage writes into the workdir, is skipped when its output is complete and resumes after an
interruption:

    trajectories.jsonl          collect: K trajectories per training question (token-exact)
    judged.jsonl                judge: the same records with outcome and per-step process verdicts
    units/<filter>.jsonl        filter: (state, action) units kept by the filter, + .stats.json
    checkpoints/{swirl,sft}/    train / sft: orbax checkpoints (resume), metrics.jsonl, tb/
    policy/{swirl,sft}/         the exported policies (Hugging Face format, load_pretrained reads them)
    eval/<policy>.json          eval: held-out metrics with 95% intervals; comparison.md, curves.png

Stage 2 never calls a tool: for each saved state it samples G fresh actions from the current
policy (one action, up to its closing tag), scores each with the reward model given the state
only (no golden answer), and trains the clipped token-level loss on the action tokens with RLOO
(or group z-score) advantages. The G actions of a state are packed as branches of one row
(training/pack.py): the state is computed once per group.

The job (`run`) reads the ConfigDict once (`read_settings`) into a frozen `SwirlSettings`; every
stage is `stage(settings, model, tokenizer, suite)` and never sees the ConfigDict.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import jax
import numpy as np
from tqdm import tqdm

from steprl_jax import failpoints
from steprl_jax.agents.records import RecordStore, Trajectory
from steprl_jax.agents.tasks import build_suite, rollout_config
from steprl_jax.algorithms import sft as sft_lib
from steprl_jax.algorithms.base import policy_temperature
from steprl_jax.algorithms.offline import (OfflineSpec, export_adapters, lora_fields, optimizer_config, remat_of,
                                           train_offline, update_key)
from steprl_jax.algorithms.workdir import (IncompatibleRunError, check_manifest, key_differences, mark_stage,
                                           reopen_stage, stage_marker)
from steprl_jax.data.units import Unit, read_units, write_units
from steprl_jax.errors import ConfigError
from steprl_jax.io import write_json_atomic
from steprl_jax.models.lora import LoraConfig
from steprl_jax.ops.advantages import group_advantages
from steprl_jax.training import LossConfig, OptimizerConfig, distributed
from steprl_jax.training.learner import LearnerSettings
from steprl_jax.training.pack import Row, Span

if TYPE_CHECKING:
    from steprl_jax.agents.rollout import RolloutConfig

log = logging.getLogger(__name__)

STAGES = ("collect", "judge", "filter", "train", "sft", "eval")
FILTERS = ("none", "process", "outcome", "process_outcome")
GRANULARITIES = ("trajectory", "step")
ADVANTAGES = ("rloo", "zscore")  # the ops.advantages estimators stage 2 offers


# ----------------------------------------------------------------------------- settings
MULTI_PROCESS_STAGES = ("train", "sft")  # the stages that run across processes (jax.distributed)


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
    batch_size: int  # trajectories per judging call
    samples_from_policy: bool  # a "local" outcome or process judge: it samples from the policy
    judging: Callable  # (outcome_rule=, local_model=, solution_reference=) -> Judging, built when the stage runs


@dataclasses.dataclass(frozen=True)
class FilterSettings:
    strategy: str  # one of FILTERS
    granularity: str  # one of GRANULARITIES
    drop_easy: bool


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Stage 2: offline step-wise RL."""
    stage2: Stage2Settings  # without stop strings: they are the environment's, known once the suite is built
    learner: LearnerSettings
    batch_size: int  # states per update
    updates: int
    save_every: int
    reward: dict  # config.reward (judges.rewards.build_reward_model)
    reward_cache_dir: Optional[str]


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """The SFT baseline. Its number of updates depends on the units, so its optimizer is made in the stage."""
    epochs: int
    batch_size: int  # trajectories per update
    save_every: int
    num_microbatches: int
    max_microbatch_tokens: int
    remat: Optional[str]
    lora: Optional[LoraConfig]
    optimizer: Callable[[int], OptimizerConfig]  # total train steps -> config.optimizer for that run


@dataclasses.dataclass(frozen=True)
class SwirlSettings:
    """Everything the SWiRL job reads from its ConfigDict (`read_settings`); the stages take only this."""
    workdir: str
    stages: tuple  # the stages to run, in pipeline order
    manifest: dict  # the run's fields a resumed run must match (workdir.check_manifest)
    stage_keys: dict  # stage to run -> the settings its output depends on beyond the manifest (`_stage_key`)
    seed: int
    progress: bool
    base_source: str  # config.model.source: the policy to start from, the exported policies' base
    mesh: distributed.MeshSpec  # config.mesh: where the trainer and the samplers run (training/distributed.py)
    export_adapters: bool
    rollout: RolloutConfig  # collect's; its max_context bounds stage 2's sampler too
    samples_per_question: int  # K
    judge: JudgeSettings
    filter: FilterSettings
    train: TrainSettings
    sft: SftSettings
    build_suite: Callable  # () -> the training TaskSuite (agents/tasks.py), built when a stage needs it
    load_policy: Callable  # (source=None, *, sampling=False) -> (model, tokenizer) (distributed.load_policy)
    evaluate: Callable  # (policy, *, out_dir, name) -> held-out metrics (evaluation/runner.py, config.eval)

    def path(self, *parts) -> str:
        return os.path.join(self.workdir, *parts)

    @property
    def units_path(self) -> str:
        """The filter's output, the input of stage 2 and SFT."""
        return self.path("units", f"{self.filter.strategy}_{self.filter.granularity}.jsonl")


def read_settings(config) -> SwirlSettings:
    """The job's settings, checked before anything loads (a ConfigError naming the field)."""
    _check_config(config)
    stages = _stages(config)
    s = config.swirl
    lora = LoraConfig.from_config(config.get("lora"))
    return SwirlSettings(
        workdir=str(config.workdir), stages=tuple(stages), manifest=_manifest(config),
        stage_keys={stage: _stage_key(config, stage) for stage in stages}, seed=int(config.seed),
        progress=bool(config.progress), base_source=config.model.source,
        mesh=distributed.MeshSpec.from_config(config.get("mesh")), export_adapters=export_adapters(config),
        rollout=rollout_config(config), samples_per_question=int(s.samples_per_question),
        judge=_judge_settings(config),
        filter=FilterSettings(strategy=s.filter, granularity=s.granularity, drop_easy=bool(s.drop_easy)),
        train=_train_settings(config, lora), sft=_sft_settings(config, lora),
        build_suite=functools.partial(build_suite, config, split="train"),
        load_policy=functools.partial(distributed.load_policy, config), evaluate=_held_out_evaluation(config))


def _stages(config) -> list[str]:
    names = [s.strip() for s in str(config.stages).split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown:
        raise ConfigError(f"config.stages: unknown stage(s) {unknown}; valid: {', '.join(STAGES)}")
    single = [s for s in names if s not in MULTI_PROCESS_STAGES]
    if jax.process_count() > 1 and single:
        raise ConfigError(f"config.stages: {single} run in one process; with {jax.process_count()} processes run "
                         f"only {MULTI_PROCESS_STAGES} (the others first, with config.distributed.mode=off)")
    return [s for s in STAGES if s in names]


def _check_config(config) -> None:
    s = config.swirl
    if s.filter not in FILTERS:
        raise ConfigError(f"config.swirl.filter: {s.filter!r} is not one of {FILTERS}")
    if s.granularity not in GRANULARITIES:
        raise ConfigError(f"config.swirl.granularity: {s.granularity!r} is not one of {GRANULARITIES}")
    if s.train.advantage not in ADVANTAGES:
        raise ConfigError(f"config.swirl.train.advantage: {s.train.advantage!r} is not one of {ADVANTAGES}")
    if int(s.samples_per_question) < 1 or int(s.train.group_size) < 1:
        raise ConfigError("config.swirl.samples_per_question and config.swirl.train.group_size must be >= 1")


def _manifest(config) -> dict:
    return {"job": "swirl", "model.source": config.model.source, "task.name": config.task.name,
            "task.path": config.task.path, "task.num_tasks": int(config.task.num_tasks),
            "task.offset": int(config.task.offset), "task.seed": int(config.task.get("seed", 0)), "seed": int(config.seed),
            "swirl.samples_per_question": int(config.swirl.samples_per_question),
            "rollout.max_steps": int(config.rollout.max_steps), **lora_fields(config)}


def _judge_settings(config) -> JudgeSettings:
    from steprl_jax.judges.judging import Judging

    j = config.judge
    return JudgeSettings(batch_size=max(1, int(j.batch_size)),
                         samples_from_policy="local" in (j.outcome.kind, j.process.kind),
                         judging=functools.partial(Judging.from_config, config))


def _train_settings(config, lora: Optional[LoraConfig]) -> TrainSettings:
    t = config.swirl.train
    steps = int(t.updates) * int(t.ppo_epochs) * int(t.minibatches)
    loss = LossConfig(kind="policy", agg=t.agg, eps_low=float(t.eps_low), eps_high=float(t.eps_high),
                      kl_coef=float(t.kl_coef), temperature=policy_temperature(config))
    learner = LearnerSettings(loss, optimizer_config(config, steps), ppo_epochs=int(t.ppo_epochs),
                              minibatches=int(t.minibatches), num_microbatches=int(t.num_microbatches),
                              max_microbatch_tokens=int(t.max_microbatch_tokens), remat=remat_of(t),
                              min_rows=int(t.batch_size), lora=lora)
    return TrainSettings(stage2=Stage2Settings.from_config(config, stop_strings=()), learner=learner,
                         batch_size=int(t.batch_size), updates=int(t.updates), save_every=int(t.save_every),
                         reward=config.reward.to_dict(), reward_cache_dir=config.judge.cache_dir or None)


def _sft_settings(config, lora: Optional[LoraConfig]) -> SftSettings:
    s = config.swirl.sft
    return SftSettings(epochs=int(s.epochs), batch_size=int(s.batch_size),
                       save_every=int(config.swirl.train.save_every),  # stage 2's: config.swirl.sft has none
                       num_microbatches=int(s.num_microbatches), max_microbatch_tokens=int(s.max_microbatch_tokens),
                       remat=remat_of(s), lora=lora, optimizer=functools.partial(optimizer_config, config))


def _held_out_evaluation(config) -> Callable:
    """evaluation/runner.evaluate on the test split at config.eval's temperature and episodes per task."""
    from steprl_jax.evaluation.runner import evaluate

    eval_config = config.copy_and_resolve_references()
    with eval_config.unlocked():
        eval_config.rollout.temperature = float(config.eval.temperature)
        eval_config.rollout.episodes_per_task = int(config.eval.episodes_per_task)
    return functools.partial(evaluate, eval_config, split="test", plot=False)


def _stage_key(config, stage: str) -> dict:
    """The settings a stage's output depends on (beyond the run manifest): a completed stage with
    the same key is skipped; a stage whose key differs is refused where going on would mix data
    made with both (`_resume_allowed`) and runs afresh where it rewrites its output."""
    s, r, e = config.swirl, config.rollout, config.env
    # how a stage batches its work changes nothing it writes (the same gradient, the same samples)
    logistics = ("save_every", "num_microbatches", "max_microbatch_tokens")
    reward_settings = ("kind", "scale", "model", "votes")  # not where it is served, its timeouts, retries
    keys = {"collect": {"temperature": float(r.temperature), "top_k": int(r.top_k), "top_p": float(r.top_p),
                        "max_new_tokens": int(r.max_new_tokens), "max_context": int(r.max_context),
                        "max_result_chars": int(r.get("max_result_chars", 0)), "env.format": e.format,
                        "env.tools": list(e.tools), "env.few_shot": int(e.get("few_shot", 0)),
                        "env.invalid_action": e.get("invalid_action", "")},
            "judge": {"outcome": config.judge.outcome.kind, "process": config.judge.process.kind,
                      "outcome.model": config.judge.outcome.get("model", ""),
                      "process.model": config.judge.process.get("model", ""),
                      "outcome.votes": int(config.judge.outcome.get("votes", 1)),
                      "process.votes": int(config.judge.process.get("votes", 1))},
            "filter": {"filter": s.filter, "granularity": s.granularity, "drop_easy": bool(s.drop_easy)},
            "train": {"filter": s.filter, "granularity": s.granularity, "drop_easy": bool(s.drop_easy),
                      **{k: v for k, v in s.train.to_dict().items() if k not in logistics},
                      "reward": {k: v for k, v in config.reward.to_dict().items() if k in reward_settings},
                      "optimizer": config.optimizer.to_dict()},
            "sft": {"filter": s.filter, "granularity": s.granularity, "drop_easy": bool(s.drop_easy),
                    **{k: v for k, v in s.sft.to_dict().items() if k not in logistics},
                    "optimizer": config.optimizer.to_dict()},
            "eval": {"temperature": float(config.eval.temperature),
                     "episodes_per_task": int(config.eval.episodes_per_task),
                     "eval_path": config.task.get("eval_path", ""), "eval_offset": int(config.task.get("eval_offset", 0)),
                     "eval_num_tasks": int(config.task.get("eval_num_tasks", 0))}}
    return keys[stage]


def _vocab_size(model) -> Optional[int]:
    """The policy's vocabulary, for checking the token ids of records read back (None: unknown)."""
    return getattr(getattr(model, "config", None), "vocab_size", None)


# ----------------------------------------------------------------------------- the job
def run(config, model_and_tokenizer=None) -> dict:
    """Run the configured stages; returns a summary (the eval comparison when eval ran).
    `model_and_tokenizer` skips loading `config.model.source` (tests, notebooks)."""
    settings = read_settings(config)
    os.makedirs(settings.workdir, exist_ok=True)
    check_manifest(settings.workdir, settings.manifest)
    for stage in settings.stages:  # a resume that would mix settings is refused before the model loads
        marker = stage_marker(settings.workdir, stage)
        if marker is not None:
            _resume_allowed(settings, stage, marker)
    # With config.mesh the policy loads straight onto the trainer's mesh (training/distributed.py);
    # the stages that sample take a copy where this process samples (`_sampling_copy`).
    model, tokenizer = model_and_tokenizer or settings.load_policy()
    suite = training_suite(settings)
    summary = {}
    for stage in settings.stages:
        key = settings.stage_keys[stage]
        marker = stage_marker(settings.workdir, stage)
        if marker is not None and _resume_allowed(settings, stage, marker) and marker["complete"] \
                and stage != "eval" and _intact(settings, stage, marker):
            log.info("stage %s: complete, skipped (%s)", stage, settings.path("stages"))
            summary[stage] = marker
            continue
        t0 = time.perf_counter()
        mark_stage(settings.workdir, stage, {"key": key, "complete": False})  # a resume checks its key
        result = _STAGE_FNS[stage](settings, model, tokenizer, suite)
        # What a stage read may have changed: later stages run again (their keys kept).
        for later in STAGES[STAGES.index(stage) + 1:]:
            reopen_stage(settings.workdir, later)
        failpoints.hit("swirl.stage.before_mark")
        mark_stage(settings.workdir, stage, {**result, "key": key, "complete": True})
        failpoints.hit("swirl.stage.after_mark")
        summary[stage] = result
        log.info("stage %s done in %.1f s", stage, time.perf_counter() - t0)
    return summary


# The files a stage appends to or resumes from: made with other settings, they would be mixed.
_RESUMED_OUTPUTS = {"collect": ("trajectories.jsonl",), "judge": ("judged.jsonl",),
                    "train": ("checkpoints/swirl",), "sft": ("checkpoints/sft",), "eval": ("eval",)}


def _holds_output(path: str) -> bool:
    """Whether `path` holds something a resume would go on from: a record, a committed checkpoint
    step (a folder named by its number), an evaluation result."""
    if os.path.isfile(path):
        return os.path.getsize(path) > 0
    if not os.path.isdir(path):
        return False
    return any(name.isdigit() or name.endswith(".json") for name in os.listdir(path))


def _resume_allowed(settings: SwirlSettings, stage: str, marker: dict) -> bool:
    """False when the stage's recorded settings differ but it rewrites its output anyway (filter,
    or nothing on disk yet); an IncompatibleRunError when going on would mix two settings' data."""
    differ = key_differences(marker.get("key", {}), settings.stage_keys[stage])
    if not differ:
        return True
    present = [p for p in _RESUMED_OUTPUTS.get(stage, ()) if _holds_output(settings.path(p))]
    if present:
        detail = "; ".join(differ)
        raise IncompatibleRunError(
            f"{settings.path('stages', stage + '.json')}: stage {stage!r} was run with other settings ({detail}); "
            f"going on would mix them in {', '.join(present)}. Restore the recorded values, or remove "
            f"{', '.join(present)} and the marker to run the stage afresh (or use a new workdir)")
    return False


def _intact(settings: SwirlSettings, stage: str, marker: dict) -> bool:
    """Whether a complete stage's output still holds what its marker counted (a record store
    drops a torn last line when opened: the stage then runs again for what is missing)."""
    files = {"collect": "trajectories.jsonl", "judge": "judged.jsonl"}
    if stage not in files or "trajectories" not in marker:
        return True
    path = settings.path(files[stage])
    held = sum(1 for r in RecordStore(path) if isinstance(r, Trajectory)) if os.path.exists(path) else 0
    if held == marker["trajectories"]:
        return True
    log.warning("stage %s: %s holds %d trajectories, its marker counted %d: running it again for the missing ones",
                stage, path, held, marker["trajectories"])
    return False


def _sampling_copy(settings: SwirlSettings, model):
    """The policy where this process samples (`distributed.sampling_copy`): `model` itself without
    a trainer mesh. With several processes every process must call it."""
    return distributed.sampling_copy(model, distributed.sampler_bridge(settings.mesh))


# ----------------------------------------------------------------------------- collect
def training_suite(settings: SwirlSettings) -> Callable:
    """A function returning the job's training task suite, built on the first call only (the stages
    that need it share one)."""
    return functools.cache(settings.build_suite)


def collect(settings: SwirlSettings, model, tokenizer, suite=None) -> dict:
    """Stage 1: K trajectories per training question at temperature > 0, tools live."""
    from steprl_jax.agents.rollout import RolloutEngine
    from steprl_jax.sampling import Sampler

    if settings.rollout.temperature <= 0:
        raise ConfigError("config.rollout.temperature: SWiRL collects K samples per question at temperature > 0")
    suite = (suite or training_suite(settings))()
    k = settings.samples_per_question
    store = RecordStore(settings.path("trajectories.jsonl"))
    done = store.done_ids()
    episodes = [(f"{t.id}#{e}", t) for t in suite.tasks for e in range(k)]
    # In waves that resume whole (RolloutEngine.run_in_waves): a resumed run samples for the
    # missing episodes exactly what an uninterrupted run would have, token for token.
    todo = [episode for episode in episodes if episode[0] not in done]
    if todo:
        sampler = Sampler(_sampling_copy(settings, model), tokenizer, max_context=settings.rollout.max_context)
        engine = RolloutEngine(sampler, tokenizer, suite.env, settings.rollout, seed=settings.seed)
        bar = tqdm(total=len(todo), desc="collect", disable=not settings.progress)
        try:
            for trajectory in engine.run_in_waves(episodes, done):
                store.append(trajectory)
                bar.update(1)
        finally:
            bar.close()
            engine.close()
    records = [r for r in store if isinstance(r, Trajectory)]
    out = {"trajectories": len(records), "questions": len(suite.tasks),
           "terminations": dict(collections.Counter(r.termination for r in records))}
    return out


# ----------------------------------------------------------------------------- judge
def judge(settings: SwirlSettings, model, tokenizer, suite=None) -> dict:
    """Process verdicts on every step (no golden answer) and the outcome per trajectory."""
    source = settings.path("trajectories.jsonl")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source}: no trajectories; run the 'collect' stage first")
    suite = (suite or training_suite(settings))()
    tasks = {t.id: t for t in suite.tasks}
    if settings.judge.samples_from_policy:
        model = _sampling_copy(settings, model)
    judging = settings.judge.judging(outcome_rule=suite.outcome_rule, local_model=(model, tokenizer),
                                     solution_reference=suite.solution_reference)
    out_store = RecordStore(settings.path("judged.jsonl"))
    done = out_store.done_ids()
    todo = [r for r in RecordStore(source, vocab_size=_vocab_size(model)) if isinstance(r, Trajectory)
            and r.id not in done]
    size = settings.judge.batch_size
    bar = tqdm(total=len(todo), desc="judge", disable=not settings.progress)
    for start in range(0, len(todo), size):
        batch = todo[start:start + size]
        missing = [t.query_id for t in batch if t.query_id not in tasks]
        if missing:
            raise ValueError(f"{source}: records of questions {missing[:3]} are not in the configured task set")
        for trajectory in judging.judge([(tasks[t.query_id], t) for t in batch]):
            out_store.append(trajectory)
        bar.update(len(batch))
    bar.close()
    judged = [r for r in out_store if isinstance(r, Trajectory)]
    labels = collections.Counter(v.get("label") for t in judged for v in t.judgements.get("process", []))
    outcomes = collections.Counter(t.judgements.get("outcome", {}).get("label") for t in judged)
    out = {"trajectories": len(judged), "process_labels": dict(labels), "outcome_labels": dict(outcomes)}
    return out


# ----------------------------------------------------------------------------- filter
def _process_labels(t: Trajectory) -> list[Optional[str]]:
    labels = [v.get("label") for v in t.judgements.get("process", [])]
    return labels + [None] * (len(t.steps) - len(labels))


def _outcome_label(t: Trajectory) -> Optional[str]:
    return t.judgements.get("outcome", {}).get("label")


def easy_questions(trajectories: Sequence[Trajectory]) -> set:
    """Questions answered correctly with at most one tool call in every sample (METHODS 1.1)."""
    by_question = collections.defaultdict(list)
    for t in trajectories:
        by_question[t.query_id].append(t)
    return {q for q, ts in by_question.items()
            if all(_outcome_label(t) == "true" and sum(len(s.tool_calls) for s in t.steps) <= 1 for t in ts)}


def trajectory_units(t: Trajectory) -> list[Unit]:
    """Every step of `t` as a unit: the state's exact ids, the action's ids and log-probs."""
    units, history = [], ""
    labels = _process_labels(t)
    for i, step in enumerate(t.steps):
        units.append(Unit(trajectory_id=t.id, query_id=t.query_id, step_index=i, question=t.question,
                          history_text=history, action_text=step.action_text, state_ids=tuple(t.state_ids(i)),
                          action_ids=tuple(step.action_ids), action_logprobs=tuple(step.action_logprobs),
                          process_label=labels[i], outcome_label=_outcome_label(t)))
        history += step.action_text + step.observation_text
    return units


def filter_units(trajectories: Sequence[Trajectory], strategy: str, granularity: str = "trajectory",
                 drop_easy: bool = False) -> tuple[list[Unit], dict]:
    """Apply `strategy` (none | process | outcome | process_outcome) at trajectory granularity
    (the paper: keep a trajectory only if every step is GOOD) or step granularity (keep the GOOD
    steps). A failed verdict is neither GOOD nor correct: its step or trajectory is not kept."""
    if strategy not in FILTERS or granularity not in GRANULARITIES:
        raise ValueError(f"filter {strategy!r}/{granularity!r}: expected one of {FILTERS} / {GRANULARITIES}")
    easy = easy_questions(trajectories) if drop_easy else set()
    kept_units, kept_trajectories, kept_wrong, kept_unknown = [], 0, 0, 0
    use_process = strategy in ("process", "process_outcome")
    use_outcome = strategy in ("outcome", "process_outcome")
    for t in trajectories:
        if t.query_id in easy or not t.steps:
            continue
        units = trajectory_units(t)
        if use_outcome and _outcome_label(t) != "true":
            continue
        if use_process:
            if granularity == "trajectory" and not all(u.process_label == "GOOD" for u in units):
                continue
            units = [u for u in units if u.process_label == "GOOD"]
        if not units:
            continue
        kept_units += units
        kept_trajectories += 1
        kept_wrong += _outcome_label(t) == "false"
        kept_unknown += _outcome_label(t) not in ("true", "false")
    labels = collections.Counter(l for t in trajectories for l in _process_labels(t))
    stats = {"filter": strategy, "granularity": granularity, "trajectories": len(trajectories),
             "steps": sum(len(t.steps) for t in trajectories), "easy_questions_dropped": len(easy),
             "kept_trajectories": kept_trajectories, "kept_units": len(kept_units),
             "kept_trajectories_with_wrong_answer": kept_wrong,
             "kept_trajectories_outcome_not_true_or_false": kept_unknown,
             "process_labels": {str(k): v for k, v in labels.items()},
             "outcome_labels": dict(collections.Counter(str(_outcome_label(t)) for t in trajectories))}
    return kept_units, stats


def filter_stage(settings: SwirlSettings, model=None, tokenizer=None, suite=None) -> dict:
    source = settings.path("judged.jsonl")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source}: no judged trajectories; run the 'judge' stage first")
    # By id: the collection writes episodes as they end, an order that depends on timing.
    trajectories = sorted((r for r in RecordStore(source, vocab_size=_vocab_size(model)) if isinstance(r, Trajectory)),
                          key=lambda r: r.id)
    f = settings.filter
    units, stats = filter_units(trajectories, f.strategy, f.granularity, f.drop_easy)
    path = settings.units_path
    write_units(path, units)
    write_json_atomic(path[:-len(".jsonl")] + ".stats.json", stats)
    return stats


# ----------------------------------------------------------------------------- stage 2
@dataclasses.dataclass(frozen=True)
class Stage2Settings:
    group_size: int  # G actions sampled per state
    max_new_tokens: int
    advantage: str  # an ops.advantages group estimator: rloo | zscore
    scale_by_std: bool
    seed: int
    temperature: float
    stop: tuple  # the environment's stop strings

    @classmethod
    def from_config(cls, config, stop_strings: Sequence[str]) -> "Stage2Settings":
        t = config.swirl.train
        return cls(group_size=int(t.group_size), max_new_tokens=int(config.rollout.max_new_tokens),
                   advantage=str(t.advantage), scale_by_std=bool(t.scale_by_std), seed=int(config.seed),
                   temperature=policy_temperature(config), stop=tuple(stop_strings))


class Stage2Builder:
    """Stage-2 rows for a batch of saved states: G fresh actions each from the current policy,
    rewards from the reward model (state + action only), group advantages, one packed row per
    state. Never calls a tool: it holds no tool registry."""

    def __init__(self, settings: Stage2Settings, sampler, tokenizer, reward_model):
        self.settings, self.sampler, self.tokenizer, self.reward_model = settings, sampler, tokenizer, reward_model

    def __call__(self, units: Sequence[Unit], update: int, policy) -> tuple[list[Row], dict]:
        """Sample j (state j // G) uses fold_in(update key, j). With several processes each
        samples and scores its share of the states; the samples are gathered in order."""
        t0 = time.perf_counter()
        self.sampler.set_params(policy)  # the current parameters, no recompilation
        G = self.settings.group_size
        mine = [i for i, _ in distributed.share(units)]
        local, sample_s = self._samples(units, mine, update)
        t1 = time.perf_counter()
        # every process's samples, back in order: process p sampled the states p, p + P, ...
        samples = [None] * (len(units) * G)
        for p, share in enumerate(distributed.allgather_json(local)):
            rows_of_p = [i * G + g for i, _ in distributed.share(units, p, jax.process_count()) for g in range(G)]
            for j, x in zip(rows_of_p, share):
                samples[j] = x
        values = [x["reward"] if x["tokens"] else None for x in samples]
        groups = [i // G for i in range(len(values))]
        adv = group_advantages(values, groups, len(units), self.settings.advantage,
                                 scale_by_std=self.settings.scale_by_std)
        rows = []
        for i, unit in enumerate(units):
            branches = [[Span(samples[j]["tokens"], loss=True, logprobs=samples[j]["logprobs"],
                              advantage=float(adv[j]))]
                        for j in range(i * G, (i + 1) * G) if values[j] is not None]
            if branches:
                rows.append(Row([Span(unit.state_ids)], branches))
        scored = [v for v in values if v is not None]
        metrics = {"reward": float(np.mean(scored)) if scored else float("nan"),
                   "reward_failed": float(sum(x["reward"] is None for x in samples)),
                   "samples": float(len(values)), "sampled_tokens": float(sum(len(x["tokens"]) for x in samples)),
                   "advantage_abs": float(np.mean(np.abs(adv))), "sample_s": sample_s,
                   "reward_s": t1 - t0 - sample_s, "states": float(len(units))}
        return rows, metrics

    def _samples(self, units: Sequence[Unit], mine: Sequence[int], update: int) -> tuple[list[dict], float]:
        """G actions for each of the states `mine` (indices into `units`) and their rewards:
        token ids, log-probs and reward (None: the reward model failed), as plain lists; and the
        seconds spent sampling."""
        from steprl_jax.judges.rewards import RewardItem
        from steprl_jax.sampling import SamplingParams

        if not mine:
            return [], 0.0
        G = self.settings.group_size
        t0 = time.perf_counter()
        state = self.sampler.prefill([list(units[i].state_ids) for i in mine])
        state = self.sampler.fork(state, [r for r in range(len(mine)) for _ in range(G)])
        index = np.asarray([i * G + g for i in mine for g in range(G)], np.uint32)  # row -> global sample index
        s = self.settings
        keys = jax.vmap(jax.random.fold_in, (None, 0))(update_key(s.seed, update), index)
        _, gens = self.sampler.generate(state, keys, max_new_tokens=s.max_new_tokens,
                                        params=SamplingParams(temperature=s.temperature), stop=s.stop)
        gens = gens[:len(mine) * G]
        sample_s = time.perf_counter() - t0
        items = [RewardItem(units[i].question, units[i].history_text, (gen.text or "") + gen.text_after_stop)
                 for i, gen in zip([i for i in mine for _ in range(G)], gens)]
        rewards = self.reward_model.score(items)
        return [{"tokens": gen.tokens.tolist(), "logprobs": gen.logprobs.tolist(), "reward": r.value}
                for gen, r in zip(gens, rewards)], sample_s


def train(settings: SwirlSettings, model, tokenizer, suite=None) -> dict:
    """Stage 2: offline step-wise RL on the filtered units' states."""
    from steprl_jax.judges.rewards import build_reward_model
    from steprl_jax.sampling import Sampler

    t = settings.train
    units = read_units(settings.units_path)
    check_manifest(settings.workdir, {"swirl.filter": settings.filter.strategy,
                                      "swirl.granularity": settings.filter.granularity})
    suite = suite or training_suite(settings)  # for the stop strings only; no tool is called
    local = _sampling_copy(settings, model)  # the sampler's first parameters, a local reward model's
    sampler = Sampler(local, tokenizer, max_context=settings.rollout.max_context,
                      mesh=distributed.sampler_mesh(settings.mesh))
    reward_model = build_reward_model(t.reward, local_model=(local, tokenizer), cache_dir=t.reward_cache_dir)
    stage2 = dataclasses.replace(t.stage2, stop=tuple(suite().env.stop_strings))
    builder = Stage2Builder(stage2, sampler, tokenizer, reward_model)
    spec = OfflineSpec("swirl", units, builder, t.learner, batch_size=t.batch_size, updates=t.updates,
                       save_every=t.save_every, needs_policy=True)
    trained = train_offline(spec, model, workdir=settings.workdir, seed=settings.seed, progress=settings.progress,
                            base_source=settings.base_source, mesh=settings.mesh)
    trained_steps = trained.step
    if trained_steps:
        trained.export(tokenizer, settings.path("policy", "swirl"), adapters=settings.export_adapters,
                       base_source=settings.base_source)
    else:  # every update skipped (e.g. the reward endpoint was down): no policy to call SWiRL
        log.warning("stage 2 trained no update (every sample dropped); policy/swirl not exported")
    out = {"updates": t.updates, "train_steps": trained_steps, "units": len(units),
           "reward_stats": reward_model.stats.snapshot()}
    return out


def sft(settings: SwirlSettings, model, tokenizer, suite=None) -> dict:
    """The paper's baseline: next-token loss on the action tokens of the same filtered units."""
    s = settings.sft
    groups = sft_lib.group_by_trajectory(read_units(settings.units_path))
    updates = max(1, -(-len(groups) * s.epochs // s.batch_size))
    learner = LearnerSettings(sft_lib.LOSS, s.optimizer(updates), num_microbatches=s.num_microbatches,
                              max_microbatch_tokens=s.max_microbatch_tokens, remat=s.remat, lora=s.lora)
    spec = OfflineSpec("sft", groups, lambda items, update, policy: (sft_lib.sft_rows(items), {}), learner,
                       batch_size=s.batch_size, updates=updates, save_every=s.save_every)
    trained = train_offline(spec, model, workdir=settings.workdir, seed=settings.seed, progress=settings.progress,
                            base_source=settings.base_source, mesh=settings.mesh)
    trained.export(tokenizer, settings.path("policy", "sft"), adapters=settings.export_adapters,
                   base_source=settings.base_source)
    out = {"updates": updates, "trajectories": len(groups)}
    return out


# ----------------------------------------------------------------------------- eval
def evaluate_policies(settings: SwirlSettings, model, tokenizer, suite=None) -> dict:
    """Held-out questions with the live tool loop for base, SFT and SWiRL (those exported)."""
    from steprl_jax.evaluation.compare import write_policy_comparison

    results = {}
    for name in ("base", "sft", "swirl"):
        source = None if name == "base" else settings.path("policy", name)
        if source is not None and not os.path.isdir(source):
            continue
        out = settings.path("eval", f"{name}.json")
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                results[name] = json.load(f)
            continue
        # where evaluation samples: a copy of the base; the exports loaded straight there
        policy = (_sampling_copy(settings, model), tokenizer) if source is None else \
            settings.load_policy(source, sampling=True)
        metrics = settings.evaluate(policy, out_dir=settings.path("eval"), name=f"{name}.")
        write_json_atomic(out, metrics)
        results[name] = metrics
    return write_policy_comparison(settings.workdir, results)


_STAGE_FNS = {"collect": collect, "judge": judge, "filter": filter_stage, "train": train, "sft": sft,
              "eval": evaluate_policies}
