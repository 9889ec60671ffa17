"""From a config to (tasks, environment, outcome rule): the task families the main job knows; and
from `config.rollout` to the rollout engine's settings (`rollout_config`).

* arithmetic — the built-in word problems (calculator, tag format; or ToRL's code format with
               the Python sandbox: env.format "code", env.tools ("python",); SimpleTIR's
               multi-turn one, env.format "code_turns"; or AgentFlow's planner with frozen
               modules and the sandbox: env.format "flow")
* gsm8k      — GSM8K JSONL (the same two formats)
* hotpotqa   — HotPotQA JSONL (BM25 search over its context paragraphs, tag format)
* toolworld  — the seeded assistant tool world (think + tool_call format), per-episode tools
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from steprl_jax.agents.environments import MAX_RESULT_CHARS, TaggedEnv, Task, ToolCallEnv, clip_result
from steprl_jax.errors import ConfigError
from steprl_jax.judges import rules
from steprl_jax.judges.items import tool_failed
from steprl_jax.tools.registry import ToolRegistry


@dataclasses.dataclass
class TaskSuite:
    tasks: list[Task]
    env: object  # TaggedEnv | ToolCallEnv | CodeEnv
    # (task, trajectory) -> "true" | "false" | "unable_to_answer"
    outcome_rule: Callable
    # task -> its expert demonstration in env's format (data/demonstrations.py), or None where the
    # task has none; None: the suite has no demonstrations (SFT warm starts read them)
    demonstrate: Optional[Callable] = None
    # task -> its reference solution (judges.items.SolutionReference) for the reference-guided
    # step judge, or None: the math tasks have them
    solution_reference: Optional[Callable] = None


# The arithmetic and tool-world tasks are generated: past this many a run builds tasks for
# minutes (a billion grew memory at ~20 MB/s with no output), and every arithmetic split still
# holds this many distinct questions.
MAX_GENERATED_TASKS = 10_000


def _window(config) -> tuple[int, int]:
    """(task.offset, task.num_tasks); a count below 1 is an error, never a default."""
    offset, count = int(config.task.offset), int(config.task.num_tasks)
    if count < 1:
        raise ConfigError(f"config.task.num_tasks: {count} is not allowed (an integer >= 1)")
    if offset < 0:
        raise ConfigError(f"config.task.offset: {offset} is not allowed (an integer >= 0)")
    return offset, count


def _generated(config, family: str) -> int:
    """How many `family` tasks to generate: task.offset + task.num_tasks, within MAX_GENERATED_TASKS."""
    offset, count = _window(config)
    if offset + count > MAX_GENERATED_TASKS:
        raise ConfigError(f"config.task.num_tasks: {count} is not allowed (task.offset + task.num_tasks at most "
                          f"{MAX_GENERATED_TASKS}: the {family} tasks are generated)")
    return offset + count


def _select(items, config, source: str):
    """Items [task.offset, task.offset + task.num_tasks) of `items` (the tasks in `source`): all there."""
    offset, count = _window(config)
    if offset + count > len(items):
        raise ConfigError(f"config.task.num_tasks: {count} is not allowed (task.offset + task.num_tasks at most "
                          f"{len(items)}: the tasks in {source})")
    return items[offset:offset + count]


def task_seed(config) -> int:
    """The seed of the generated tasks, `task.seed` (0 where a config predates it): never the
    run's `seed`, so that every seed of an experiment is evaluated on the same questions."""
    return int(config.task.get("seed", 0))


def split_config(config, split: str):
    """`config` with `task` set for `split`: "train" is `task` itself; "test" (held-out
    evaluation) takes `task.eval_path`, `task.eval_offset` and `task.eval_num_tasks` where set."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.task.split = split
        if split == "test" and "eval_path" in config.task:
            if config.task.eval_path:
                config.task.path = config.task.eval_path
            if int(config.task.eval_num_tasks) < 1:  # named here: past this point it is task.num_tasks
                raise ConfigError(f"config.task.eval_num_tasks: {config.task.eval_num_tasks} is not allowed "
                                  f"(an integer >= 1)")
            config.task.offset = int(config.task.eval_offset)
            config.task.num_tasks = int(config.task.eval_num_tasks)
    return config


def build_suite(config, split: str | None = None, local_model=None) -> TaskSuite:
    """The tasks, environment and outcome rule of `config.task` (`split`: see `split_config`).
    `local_model`: (model, tokenizer) of the base model, the frozen modules' model of the flow
    format with `rl.flow_grpo.frozen.kind` "base" (`calls_base_model`)."""
    if split is not None:
        config = split_config(config, split)
    name = config.task.name
    if name in ("arithmetic", "gsm8k"):
        problems = _math_problems(config)
        tasks = [task for task, _ in problems]
        from steprl_jax.data.arithmetic import arithmetic_problems

        # Worked examples from a seed no evaluation set uses.
        shown = arithmetic_problems(8, seed=10_007)[1:1 + int(config.env.few_shot)]
        if config.env.format == "code":
            suite = _code_suite(config, tasks, [p.code_demonstration() for p in shown])
        elif config.env.format == "code_turns":
            suite = _code_turns_suite(config, tasks)
        elif config.env.format == "flow":
            suite = _flow_suite(config, tasks, local_model)
        else:
            examples = [p.demonstration() for p in shown]
            suite = TaskSuite(tasks, _tagged_env(config, search_index=None, examples=examples),
                              lambda task, traj: rules.gsm8k_outcome(traj.final_answer, task.reference))
        suite.demonstrate = _math_demonstrations(problems, config.env.format)
        suite.solution_reference = _solution_references(problems)
        return suite
    if config.env.format in ("code", "code_turns", "flow"):
        raise ConfigError(f"config.env.format: the {config.env.format} format runs the math tasks (arithmetic, "
                          f"gsm8k), not task.name={name!r}")
    if name == "hotpotqa":
        from steprl_jax.data.hotpotqa import load_hotpotqa
        from steprl_jax.tools.search import BM25Search

        if not config.task.path:
            raise ConfigError("config.task.path: a HotPotQA JSONL file is needed for task.name=hotpotqa")
        from steprl_jax.data.hotpotqa import hotpotqa_demonstrations

        rows = load_hotpotqa(config.task.path)
        examples = _select(rows, config, config.task.path)
        tasks = [Task(e.id, e.question, list(e.answers)) for e in examples]
        corpus = config.task.corpus_path or config.task.path
        index = (BM25Search.from_jsonl(corpus) if corpus.endswith(".jsonl") and corpus != config.task.path
                 else BM25Search.from_hotpotqa(corpus))
        # Worked search examples from the file's other rows, never sharing a title with a task.
        start, count = _window(config)
        stop = start + count
        demos = hotpotqa_demonstrations(rows[:start] + rows[stop:], index, int(config.env.few_shot),
                                        top_k=int(config.task.search_top_k), exclude=examples)
        partial = float(config.judge.partial_f1) or None
        return TaskSuite(tasks, _tagged_env(config, search_index=index, examples=demos),
                         lambda task, traj: rules.hotpotqa_outcome(traj.final_answer, task.reference, partial))
    if name == "toolworld":
        return _toolworld_suite(config)
    raise ConfigError(f"config.task.name: unknown task {name!r} (arithmetic, gsm8k, hotpotqa, toolworld)")


def rollout_config(config):
    """The `agents.rollout.RolloutConfig` of `config.rollout`: what every job that rolls out
    (evaluation, SWiRL's collect, the online loop) hands the rollout engine."""
    from steprl_jax.agents.rollout import RolloutConfig  # on use: the rollout engine starts JAX

    r = config.rollout
    return RolloutConfig(max_steps=int(r.max_steps), max_new_tokens=int(r.max_new_tokens),
                         max_context=int(r.max_context), temperature=float(r.temperature), top_k=int(r.top_k),
                         top_p=float(r.top_p), batch_size=int(r.batch_size), tool_workers=int(r.tool_workers),
                         continuous=bool(r.get("continuous", True)), decode_chunk=int(r.get("decode_chunk", 16)),
                         deterministic=bool(r.get("deterministic", True)),
                         max_result_chars=int(r.get("max_result_chars", RolloutConfig.max_result_chars)))


def _math_problems(config) -> list[tuple[Task, object]]:
    """The math tasks of `config`, each with its problem (gold steps: `ArithmeticProblem`,
    `GSM8KProblem`), in order."""
    if config.task.name == "arithmetic":
        from steprl_jax.data.arithmetic import arithmetic_problems, arithmetic_split

        n = _generated(config, "arithmetic")
        problems = (arithmetic_split(config.task.split, n, seed=task_seed(config))
                    if config.task.split in ("train", "test") and config.task.get("splits", False)
                    else arithmetic_problems(n, seed=task_seed(config)))
        return [(Task(p.id, p.question, p.answer), p) for p in _select(problems, config, "the built-in arithmetic set")]
    from steprl_jax.data.gsm8k import load_gsm8k

    if not config.task.path:
        raise ConfigError("config.task.path: a GSM8K JSONL file is needed for task.name=gsm8k")
    problems = load_gsm8k(config.task.path)
    offset = int(config.task.offset)
    return [(Task(f"gsm8k-{offset + i}", p.question, p.answer), p)
            for i, p in enumerate(_select(problems, config, config.task.path))]


def _math_demonstrations(problems: list, env_format: str) -> Optional[Callable]:
    """task -> the gold steps of its problem in `env_format` (the flow format: the planner's first
    turn handing them to the python tool); None where a step is not plain arithmetic (some GSM8K
    annotations) and so has no output Python would print for certain. None for a format the
    problems cannot be shown in."""
    from steprl_jax.agents.flow import PYTHON_CODER

    shown = {"tags": lambda p: p.demonstration(), "code": lambda p: p.code_demonstration(),
             "code_turns": lambda p: p.code_turns_demonstration(),
             "flow": lambda p: p.flow_demonstration(PYTHON_CODER)}.get(env_format)
    if shown is None:
        return None
    by_id = {task.id: problem for task, problem in problems}

    def demonstrate(task: Task):
        try:
            return shown(by_id[task.id])
        except ValueError:
            return None

    return demonstrate


def _solution_references(problems: list) -> Callable:
    """task -> the `SolutionReference` of its problem (every gold quantity, the answer)."""
    from steprl_jax.judges.items import SolutionReference

    by_id = {task.id: problem for task, problem in problems}

    def reference(task: Task):
        return SolutionReference(by_id[task.id].solution_quantities(), task.reference)

    return reference


def sandbox_settings(config):
    """The Python sandbox's limits from `config.env.python` (tools/python_sandbox.py defaults for
    the fields it leaves out)."""
    from steprl_jax.tools.python_sandbox import SandboxSettings

    p = config.env.get("python", {})
    fields = dict(wall_timeout_s=float, cpu_s=int, memory_bytes=int, stdout_chars=int, max_concurrent=int,
                  queue_timeout_s=float)
    values = {name: kind(p[name]) for name, kind in fields.items() if name in p}
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"config.env.python.{name} must be > 0, got {value}")
    return SandboxSettings(**values)


def _code_suite(config, tasks: list[Task], examples) -> TaskSuite:
    """ToRL's code format with the Python sandbox; outcome: math-verify of the response's last
    \\boxed{} against the reference (true +1, wrong or missing false -1)."""
    from steprl_jax.agents.code_env import CodeEnv, response_answer
    from steprl_jax.tools.python_sandbox import python_tool

    _check_python_tools(config)
    max_calls = int(config.env.get("max_tool_calls", 1))
    if max_calls < 0:
        raise ConfigError(f"config.env.max_tool_calls must be >= 0, got {max_calls}")
    settings = sandbox_settings(config)
    registry = ToolRegistry([python_tool(settings)], max_workers=int(config.rollout.tool_workers))
    env = CodeEnv(registry, max_tool_calls=max_calls, examples=examples)
    return TaskSuite(tasks, env, lambda task, traj: rules.math_verify_outcome(response_answer(traj), task.reference))


def _code_turns_suite(config, tasks: list[Task]) -> TaskSuite:
    """SimpleTIR's multi-turn code format with the Python sandbox (SimpleTIR's prompt carries its
    own example: no few-shot turns); outcome: math-verify of the response's last \\boxed{}, as
    the code format's."""
    from steprl_jax.agents.code_env import CodeTurnsEnv, render_run, response_answer
    from steprl_jax.tools.python_sandbox import python_tool

    _check_python_tools(config)
    if int(config.env.few_shot):
        raise ConfigError(f"config.env.few_shot: the code_turns format shows no worked examples (SimpleTIR's "
                          f"prompt has its own); set 0, got {config.env.few_shot}")
    registry = ToolRegistry([python_tool(sandbox_settings(config), render=render_run)],
                            max_workers=int(config.rollout.tool_workers))
    return TaskSuite(tasks, CodeTurnsEnv(registry),
                     lambda task, traj: rules.math_verify_outcome(response_answer(traj), task.reference))


def _check_python_tools(config) -> None:
    from steprl_jax.agents.code_env import PYTHON_TOOL

    if tuple(config.env.tools) != (PYTHON_TOOL,):
        raise ConfigError(f"config.env.tools: the {config.env.format} format runs ({PYTHON_TOOL!r},), "
                          f"got {tuple(config.env.tools)}")


def calls_base_model(config) -> bool:
    """Whether the suite's environment calls the base model (`build_suite`'s `local_model`): the
    flow format's frozen modules of kind "base" do."""
    return config.env.format == "flow" and config.rl.flow_grpo.frozen.kind == "base"


def _flow_suite(config, tasks: list[Task], local_model) -> TaskSuite:
    """AgentFlow's system (agents/flow.py): the planner is the policy; the executor, verifier and
    solution generator are `rl.flow_grpo.frozen`; the python tool is the sandbox. Outcome:
    math-verify of the solution's answer against the reference (+1 / -1)."""
    from steprl_jax.agents import flow
    from steprl_jax.tools.python_sandbox import python_tool

    _check_python_tools(config)
    f, frozen = config.rl.flow_grpo, config.rl.flow_grpo.frozen
    tools = tuple(f.tools)
    if not tools or any(t not in flow.TOOLS for t in tools):
        raise ConfigError(f"config.rl.flow_grpo.tools: {tools} is not a non-empty selection of {tuple(flow.TOOLS)}")
    sampling = dict(temperature=float(frozen.temperature), max_tokens=int(frozen.max_tokens))
    if frozen.kind == "http":
        if not frozen.base_url or not frozen.model:
            raise ConfigError("config.rl.flow_grpo.frozen.base_url: kind http needs base_url and model")
        model = flow.http_frozen_model(str(frozen.base_url), str(frozen.model), api_key_env=str(frozen.api_key_env),
                                       timeout_s=float(frozen.timeout_s), **sampling)
    elif frozen.kind == "base":
        if local_model is None:
            raise ConfigError("config.rl.flow_grpo.frozen.kind: 'base' needs the base model (this job gives "
                              "none); use kind 'http'")
        model = flow.base_frozen_model(*local_model, max_context=int(config.rollout.max_context),
                                       seed=int(config.seed), **sampling)
    else:
        raise ConfigError(f"config.rl.flow_grpo.frozen.kind: {frozen.kind!r} is not 'base' or 'http'")
    registry = ToolRegistry([python_tool(sandbox_settings(config))], max_workers=int(config.rollout.tool_workers))
    env = flow.FlowEnv(registry, model, tool_names=tools, result_chars=int(f.memory_chars))
    return TaskSuite(tasks, env, lambda task, traj: rules.math_verify_outcome(traj.final_answer, task.reference))


def _tagged_env(config, search_index, examples=()) -> TaggedEnv:
    from steprl_jax.tools.calculator import calculator_tool
    from steprl_jax.tools.search import search_tool

    tools = []
    for name in config.env.tools:
        if name == "calculator":
            tools.append(calculator_tool())
        elif name == "search":
            if search_index is None:
                raise ConfigError("config.env.tools: 'search' needs a corpus (task.name=hotpotqa or task.corpus_path)")
            tools.append(search_tool(search_index, k=int(config.task.search_top_k)))
        else:
            raise ConfigError(f"config.env.tools: unknown tool {name!r} for the tag format (calculator, search)")
    registry = ToolRegistry(tools, default_timeout_s=float(config.rollout.tool_timeout_s),
                            max_workers=int(config.rollout.tool_workers))
    return TaggedEnv(registry, invalid_action=config.env.invalid_action, examples=examples)


TRAIN_POOL = 1024  # tool-world training queries a held-out split never shares a question with


def toolworld_queries(config, split: str | None = None):
    """(world, queries) behind the tool-world suite of `config` (`split`: see `split_config`):
    the queries are those of `build_suite(config, split).tasks`, in order, with their reference
    plans (expert demonstrations need them)."""
    if split is not None:
        config = split_config(config, split)
    world, _, queries = _toolworld_data(config)
    return world, queries


def _toolworld_data(config):
    from steprl_jax.tools.world.generate import generate_world
    from steprl_jax.tools.world.queries import make_splits

    world = generate_world(int(config.task.world_seed))
    n = _generated(config, "toolworld")
    # The test split excludes every question of a fixed train pool, whatever this split's size:
    # question texts repeat across contexts, and a test set sized by its own count would exclude
    # only that many train questions (21 of 64 test questions were train questions 65-1024).
    splits = make_splits(int(config.task.world_seed), max(n, TRAIN_POOL), n, seed=task_seed(config))
    if config.task.split not in splits:
        raise ConfigError(f"config.task.split: {config.task.split!r} is not one of {sorted(splits)}")
    if config.task.split == "test_held_out":  # the held-out templates' share of n test queries: fewer than n
        return world, splits, splits["test_held_out"][int(config.task.offset):]
    return world, splits, _select(splits[config.task.split], config, f"the tool world's {config.task.split} split")


def _toolworld_suite(config) -> TaskSuite:
    from steprl_jax.tools.world.tools import make_registry

    world, splits, queries = _toolworld_data(config)
    offered = _offered_tools(config)
    by_id = {q.id: q for q in queries}
    tasks = [Task(q.id, q.question, q.answer, {"context": _context_line(q)}) for q in queries]
    failure_rate = float(config.task.failure_rate)
    latency_s = (float(config.task.get("latency_min_s", 0.0)), float(config.task.get("latency_max_s", 0.0)))
    if not 0.0 <= latency_s[0] <= latency_s[1]:
        raise ConfigError(f"config.task.latency_min_s / latency_max_s: need 0 <= min <= max, got {latency_s}")

    def registry_for(task: Task) -> ToolRegistry:
        return make_registry(world, by_id[task.id].context, failure_rate=failure_rate, salt=task.id,
                             latency_s=latency_s, names=offered)

    # tool_rendering: "json" (the schemas, as the chat template takes them) | "compact" (one line a tool).
    env = ToolCallEnv(registry_factory=registry_for, invalid_action=config.env.invalid_action,
                      examples=_toolworld_examples(world, [q for q in splits["train"] if _plan_offered(q, offered)],
                                                   int(config.env.few_shot)),
                      tool_rendering=str(config.env.get("tool_rendering", "json")))

    def outcome(task: Task, traj) -> str:
        return rules.toolworld_outcome(traj.final_answer, task.reference, tool_failed(traj))

    max_result_chars = int(config.rollout.get("max_result_chars", MAX_RESULT_CHARS))

    def demonstrate(task: Task):
        """The query's reference plan as think + tool_call actions, its calls executed without
        injected failures and their results cut as the rollout cuts them."""
        from steprl_jax.data.demonstrations import tool_call_demonstration
        from steprl_jax.data.toolworld import execute_plan

        query = by_id[task.id]
        if not _plan_offered(query, offered):  # its plan calls a tool this run does not offer
            return None
        results = [[clip_result(r, max_result_chars) for r in step] for step in execute_plan(world, query)]
        return tool_call_demonstration(query.question, query.plan, results)

    return TaskSuite(tasks, env, outcome, demonstrate)


def _offered_tools(config) -> Optional[tuple]:
    """`config.env.tools` for the tool world: the tools every episode offers, listed in its prompt
    (empty: all of them; None is returned). Queries stay as they are: one whose plan needs a tool
    not offered has no expert demonstration and is answered without it."""
    from steprl_jax.tools.world.tools import TERMINAL_TOOL, TOOL_NAMES

    offered = tuple(config.env.tools)
    unknown = [name for name in offered if name not in TOOL_NAMES]
    if unknown:
        raise ConfigError(f"config.env.tools: {unknown} are not tool-world tools ({', '.join(TOOL_NAMES)}; "
                          f"empty: all of them)")
    if offered and TERMINAL_TOOL not in offered:
        raise ConfigError(f"config.env.tools: a tool-world episode answers through {TERMINAL_TOOL!r}: list it "
                          f"too (empty: all the tools)")
    return offered or None


def _plan_offered(query, offered: Optional[tuple]) -> bool:
    """Whether every call of the query's reference plan is to an offered tool."""
    return offered is None or all(call.name in offered for step in query.plan for call in step)


def _toolworld_examples(world, train_queries, k: int) -> list[list[dict]]:
    """`k` expert demonstrations (from the train split, multi-call first) as chat messages."""
    from steprl_jax.data.toolworld import toolworld_demonstration

    chosen = sorted(train_queries, key=lambda q: (-q.tool_calls, q.id))[:k]
    examples = []
    for query in chosen:
        messages = toolworld_demonstration(world, query).as_messages()
        messages[0] = {"role": "user", "content": f"{_context_line(query)}\n\n{query.question}"}
        examples.append(messages)
    return examples


def _context_line(query) -> str:
    ctx = query.context
    return f"(The user is in {ctx.user_city}; the current time is {ctx.now_utc.isoformat()} UTC.)"
