"""`flow`: AgentFlow's rollout (reference lupantech/AgentFlow `agentflow/solver.py` `Solver.solve`;
the pieces are in agents/flow.py). Per query, `n` rollouts; each runs up to `max_turns` turns:

    planner    the policy, sampled by the engine's sampler on a FRESH prompt (query, tools, memory);
               each call is one training row: its exact prompt ids, sampled ids and log-probs
    executor   the frozen model turns (sub-goal, tool) into the tool's input (python code)
    tool       the python sandbox (or the frozen model as the generator tool); a bad step, a missing
               command or a failed run is an error result in memory, never a raise
    verifier   the frozen model says STOP or CONTINUE (not asked after the last turn: the rollout
               ends there anyway)

then the frozen solution generator writes the final answer from the memory. Every frozen call has
a seed of its own (`_frozen_seeds`): sampled frozen replies (`rl.flow_grpo.frozen.temperature` > 0)
are reproducible and a resumed run rolls out what it would have. All live rollouts of
a batch take each turn together: one prefill and one generation call for their planner prompts
(`batch_size` rows at a time), then the frozen calls and the tools concurrently.

Record: one TreeRecord per query whose leaves are the rollouts, each a chain of planner calls:
a node's step holds the planner's reply (`action_*`), its prompt (`prompt_ids`), the tool call
and result, and as `observation_text` the memory entry as the next prompts show it
(`flow.render_entry`) with the verifier's word (`observation_ids`
stay empty: nothing after a planner call is in its row). The leaf's observation also holds the
solution; `leaf_answers` the answer read from it. `record.prompt_ids` is the first planner
prompt of the query (the rows carry their own). The planner of rollout e of query j samples turn t
with fold_in(fold_in(key, j * n + e), t), so a rollout does not depend on its batch-mates' draws.
"""
from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
from typing import Sequence

import jax
import numpy as np

from steprl_jax.agents import flow
from steprl_jax.agents.records import Step, TreeNode, TreeRecord
from steprl_jax.agents.rollout import versions_of
from steprl_jax.agents.schedules.base import Query, Schedule, as_queries, start
from steprl_jax.tools.protocol import ToolResult, error_result


@dataclasses.dataclass(frozen=True)
class FlowSettings:
    n: int = 8  # rollouts per query
    max_turns: int = 3  # planner calls per rollout at most (AgentFlow trains with 3)

    def __post_init__(self):
        if self.n < 1 or self.max_turns < 1:
            raise ValueError(f"a flow rollout needs n >= 1 and max_turns >= 1 (got n={self.n}, "
                             f"max_turns={self.max_turns})")

    @classmethod
    def from_config(cls, config) -> "FlowSettings":
        return cls(n=int(config.rollout.tree.n), max_turns=int(config.rl.flow_grpo.max_turns))


@dataclasses.dataclass
class _Rollout:
    query: int  # index in the batch of queries
    index: int  # global episode index (the sampling key)
    question: str
    memory: list = dataclasses.field(default_factory=list)
    steps: list = dataclasses.field(default_factory=list)
    done: bool = False


def run(engine, queries: Sequence[Query], settings: FlowSettings, key=None, seed: int = 0) -> list[TreeRecord]:
    env = engine.env
    if not isinstance(env, flow.FlowEnv):
        raise ValueError(f"the flow schedule runs a FlowEnv (env.format 'flow'), not {type(env).__name__}")
    queries, n = as_queries(queries), settings.n
    start(engine, key)
    engine.key, run_key = jax.random.split(engine.key)
    seed_of = _frozen_seeds(run_key)
    rollouts = [_Rollout(j, q.index * n + e, q.task.question) for j, q in enumerate(queries) for e in range(n)]
    first_prompts: dict = {}
    for turn in range(settings.max_turns):
        live = [r for r in rollouts if not r.done]
        if not live:
            break
        live = _plan(engine, env, live, run_key, turn, first_prompts)
        _act(env, live, seed_of, turn)
        if turn + 1 < settings.max_turns:
            _verify(env, live, seed_of, turn)
    records = []
    solutions = env.frozen.complete([flow.solution_messages(r.question, _memory(env, r)) for r in rollouts],
                                    [seed_of(r.index, settings.max_turns, _SOLVE) for r in rollouts])
    for j, q in enumerate(queries):
        task = q.task
        mine = [(r, s) for r, s in zip(rollouts, solutions) if r.query == j]
        prompt = first_prompts.get(j, ([], ""))
        record = TreeRecord(q.id, task.id, task.question, prompt[1], list(prompt[0]), reference_answer=task.reference,
                            metadata={**dict(task.metadata), "flow": {"max_turns": settings.max_turns,
                                                                      "tools": list(env.tool_names)}})
        for r, solution in mine:
            _add_rollout(record, r, solution)
        records.append(record)
    for q in queries:
        env.release(q.task)
    return records


# The frozen calls of a rollout's turn, each with a seed of its own (`_frozen_seeds`).
_EXECUTE, _VERIFY, _SOLVE = range(3)


def _frozen_seeds(run_key):
    """(rollout's global index, turn, call) -> the seed of that frozen call, from the schedule's
    key: a sampled frozen reply is the same whatever the batch, the order the concurrent calls run
    in, or a restart (the planner's keys are drawn the same way). The key is read once."""
    data = np.asarray(jax.random.key_data(run_key), np.uint32).tobytes()

    def seed_of(index: int, turn: int, call: int) -> int:
        digest = hashlib.sha256(data + struct.pack("<qqq", index, turn, call)).digest()
        return int.from_bytes(digest[:7], "little")  # < 2**56: a valid seed everywhere

    return seed_of


def _memory(env, r: _Rollout) -> str:
    return flow.render_memory(r.memory, env.result_chars)


def _plan(engine, env, live: list, run_key, turn: int, first_prompts: dict) -> list:
    """Sample every live rollout's next planner reply; a prompt that leaves no room for the reply
    ends its planning. Returns the rollouts that got a reply."""
    from steprl_jax.models import chat
    from steprl_jax.sampling import SamplingParams

    c = engine.config
    max_context = min(c.max_context, getattr(engine.sampler, "max_context", c.max_context))
    prompts = []
    for r in live:
        text = chat.apply_chat(engine.tokenizer, flow.planner_messages(r.question, env.tool_names, _memory(env, r)),
                               tokenize=False)
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        first_prompts.setdefault(r.query, (ids, text))
        prompts.append(ids)
    fits = []
    for r, ids in zip(live, prompts):
        if len(ids) + c.max_new_tokens > max_context:
            r.done = True  # no room for another reply: the solution generator takes over
        else:
            fits.append((r, ids))
    params = SamplingParams(temperature=c.temperature if c.temperature > 0 else 1.0, top_k=c.top_k, top_p=c.top_p,
                            greedy=c.temperature <= 0)
    for at in range(0, len(fits), c.batch_size):
        chunk = fits[at:at + c.batch_size]
        state = engine.prefill([ids for _, ids in chunk])
        keys = np.zeros((state.num_rows, 2), np.uint32)
        for row, (r, _) in enumerate(chunk):
            keys[row] = np.asarray(jax.random.fold_in(jax.random.fold_in(run_key, r.index), turn))
        max_new = np.zeros(state.num_rows, np.int64)
        max_new[:len(chunk)] = c.max_new_tokens
        t0 = time.perf_counter()
        _, generations = engine.sampler.generate(state, keys, max_new_tokens=max_new, params=params)
        generate_s = (time.perf_counter() - t0) / len(chunk)
        engine.stats.generate_s += time.perf_counter() - t0
        engine.stats.generate_calls += 1
        for row, (r, ids) in enumerate(chunk):
            g = generations[row]
            engine.stats.generated_tokens += len(g.tokens)
            r.steps.append(Step(action_text=(g.text or "") + g.text_after_stop, action_ids=[int(t) for t in g.tokens],
                                action_logprobs=[float(x) for x in g.logprobs], finish_reason=g.finish_reason,
                                generate_s=generate_s, prompt_ids=[int(t) for t in ids],
                                action_versions=versions_of(g)))
    return [r for r, _ in fits]


def _act(env, live: list, seed_of, turn: int) -> None:
    """Parse each planner reply, have the executor write the command, run the tool, add the step to
    the memory: every failure becomes the step's error result."""
    t0 = time.perf_counter()
    parsed = [flow.parse_planner_step(r.steps[-1].action_text, env.tool_names) for r in live]
    asks, owners = [], []  # frozen calls: executor for the python tool, an answer for the generator tool
    for i, p in enumerate(parsed):
        if p.problem is None:
            asks.append(flow.executor_messages(live[i].question, p) if p.tool_name == flow.PYTHON_CODER
                        else flow.generator_messages(p))
            owners.append(i)
    seeds = [seed_of(live[i].index, turn, _EXECUTE) for i in owners]
    replies = dict(zip(owners, env.frozen.complete(asks, seeds)))
    commands, results = [""] * len(live), [None] * len(live)
    codes = []  # (index, code) to run
    for i, p in enumerate(parsed):
        if p.problem == "no_step":
            results[i] = error_result("planner", "unparseable", "no Context / Sub-Goal / Tool Name sections")
        elif p.problem == "unknown_tool":
            results[i] = error_result(p.tool_name[:64] or "planner", "unknown_tool",
                                      "No command was generated because the tool was not found.")
        elif replies[i].error:
            results[i] = error_result(p.tool_name, "frozen_model_failed", replies[i].error)
        elif p.tool_name == flow.GENERATOR:
            commands[i] = p.sub_goal
            results[i] = ToolResult(p.tool_name, replies[i].text)
        else:
            code = flow.parse_command(replies[i].text)
            if code is None:
                results[i] = error_result(p.tool_name, "no_command", "the executor wrote no complete ```python block")
            else:
                commands[i] = code
                codes.append((i, code))
    ran = env.registry.execute([{"name": env.python_tool, "arguments": {"code": code}} for _, code in codes]) \
        if codes else []
    for (i, _), result in zip(codes, ran):
        results[i] = dataclasses.replace(result, name=flow.PYTHON_CODER)
    tool_s = (time.perf_counter() - t0) / max(1, len(live))
    for r, p, command, result in zip(live, parsed, commands, results):
        shown = result.as_text() if result.ok else f"Error ({result.error_type}): {result.message}"
        entry = flow.MemoryEntry(p.tool_name, p.sub_goal, command, shown)
        r.memory.append(entry)
        step = r.steps[-1]
        step.kind = "tool_call" if p.problem is None else "invalid"
        step.format_problems = [p.problem] if p.problem else []
        step.tool_calls = ([{"name": p.tool_name, "arguments": {"sub_goal": p.sub_goal, "command": command}}]
                           if p.problem is None else [])
        step.tool_results = [result.to_json()]
        step.tool_s = tool_s
        step.observation_text = flow.render_entry(entry, env.result_chars)


def _verify(env, live: list, seed_of, turn: int) -> None:
    verdicts = env.frozen.complete([flow.verifier_messages(r.question, _memory(env, r)) for r in live],
                                   [seed_of(r.index, turn, _VERIFY) for r in live])
    for r, reply in zip(live, verdicts):
        word = flow.CONTINUE if reply.error else flow.parse_conclusion(reply.text)
        r.steps[-1].observation_text += f"\nVerifier: {word}" + (f" ({reply.error})" if reply.error else "")
        if word == flow.STOP:
            r.done = True


def _add_rollout(record: TreeRecord, r: _Rollout, solution) -> None:
    """The rollout's planner calls as a chain of the record; its leaf carries the solution."""
    if not r.steps:  # the first prompt did not fit: no row, nothing to judge
        return
    parent = -1
    for depth, step in enumerate(r.steps, start=1):
        record.nodes.append(TreeNode(parent=parent, step=step, depth=depth))
        parent = len(record.nodes) - 1
    leaf = record.nodes[parent].step
    leaf.observation_text += (f"\nSolution: {solution.text}" if not solution.error
                              else f"\nSolution failed: {solution.error}")
    answer = None if solution.error else flow.final_answer(solution.text)
    record.leaf_answers[str(parent)] = answer
    # every rollout ends with the solution generator: "answer" when it gave one, whether the verifier
    # stopped the planning or the turns ran out (the verifier's words are in the observations)
    record.leaf_terminations[str(parent)] = "answer" if answer is not None else "no_answer"


SCHEDULE = Schedule("flow", run, FlowSettings, per_episode_keys=True)
