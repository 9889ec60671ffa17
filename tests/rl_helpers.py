"""Shared set-up of the online-RL tests (test helper): tiny tool-world configs for every
algorithm and a verdict endpoint on 127.0.0.1 whose true / false / unable_to_answer depends only on
the request (deterministic across processes, so a random policy's groups have different rewards
and a resume test is not vacuous)."""
import hashlib
import json

import numpy as np

from chat_stub import ChatStub

LABELS = ("true", "false", "unable_to_answer")


def verdict_reply(body: dict) -> str:
    """PORTool's trajectory verdict; or, asked the outcome judge's YES/NO question (the formats
    whose trajectories are not judged whole: the code and flow formats), YES or NO."""
    from steprl_jax.judges.prompts import OUTCOME_SYSTEM

    text = json.dumps(body["messages"], sort_keys=True)
    draw = hashlib.sha256(text.encode()).digest()[0]
    if body["messages"][0]["content"] == OUTCOME_SYSTEM:
        return ("YES", "NO")[draw % 2]
    return f"Verdict: {LABELS[draw % 3]}"


def VerdictServer(reply=verdict_reply, status: int = 200):
    return ChatStub(lambda body, i: reply(body), status=status)


def judge_http(config, base_url: str) -> None:
    config.judge.outcome.kind = "http"
    config.judge.outcome.base_url = base_url
    config.judge.outcome.model = "stub"
    config.judge.outcome.votes = 1
    config.judge.outcome.update(dict(timeout_s=10.0, retries=0, backoff_s=0.01, max_backoff_s=0.02))


# The tool world's tools the test runs offer, those the plans of their 4 train queries call (an SFT
# warm start has a demonstration for each): a prompt of ~400 tokens instead of ~1,450 with all 23
# (a tiny policy's train step and prefill cost grow with it: a run ~3 s shorter).
TEST_TOOLS = ("geocode", "lookup_fact", "stock_history", "response_gen")


def tiny_rl_config(workdir, algorithm: str = "portool", judge_url: str = "", **rl):
    """configs/portool_toolworld.py at test sizes: 2 queries per iteration, n = 4 (f = 2),
    2 iterations, 12 new tokens, 2 steps, 3 tools, evaluation on 2 held-out queries."""
    from configs import portool_toolworld

    c = portool_toolworld.get_config()
    c.workdir = str(workdir)
    c.progress = False
    c.algorithm = algorithm
    c.task.num_tasks = 4
    c.env.tools = TEST_TOOLS
    c.rollout.max_new_tokens = 12
    c.rollout.max_steps = 2
    c.rollout.max_context = 2048
    c.rollout.tree.n = 4
    c.rollout.tree.f = 2
    c.rollout.tree.fork_depths = (1, 2)
    c.rollout.temperature = 1.0
    c.rl.iterations = 2
    c.rl.queries_per_iteration = 2
    c.rl.eval_every = 2
    c.rl.eval.num_tasks = 2
    c.rl.eval.votes = 1
    c.rl.arpo.initial = 2
    c.rl.dapo.overlong_cache = 8
    c.rl.tree_grpo.n, c.rl.tree_grpo.keep = 1, 2  # 2 trees of 2 leaves: 4 trajectories per query
    c.optimizer.learning_rate = 1e-3  # large enough that stale parameters would show in the ratio
    c.optimizer.max_grad_norm = 0.0
    for key, value in rl.items():
        setattr(c.rl, key, value)
    if judge_url:
        judge_http(c, judge_url)
    return c


# The config each action format's methods run on in these commands (the method's first format).
FORMAT_CONFIGS = {"tool_call": "configs/portool_toolworld.py", "code": "configs/torl_arithmetic.py",
                  "code_turns": "configs/simpletir_arithmetic.py", "flow": "configs/flow_grpo_arithmetic.py"}
# Test sizes of the formats that differ from the tool world's: the code formats show no worked
# example (shorter prompts); a random policy never boxes an answer, so every response of a group
# gets the same verdict: the update runs anyway (zero advantages); the flow planner takes 2 turns
# with short frozen replies, sampled (seeded per call): the solution generator's texts differ, and
# so do their verdicts.
NO_SIGNAL = ["--config.rl.skip_update_without_signal=False"]
TOOLS_FLAG = f"--config.env.tools={TEST_TOOLS!r}"
FORMAT_FLAGS = {"tool_call": ["--config.judge.outcome.retries=0", TOOLS_FLAG], "code": ["--config.env.few_shot=0", *NO_SIGNAL],
                "code_turns": NO_SIGNAL,
                "flow": ["--config.rl.flow_grpo.max_turns=2", "--config.rl.flow_grpo.frozen.max_tokens=8",
                         "--config.rl.flow_grpo.frozen.temperature=1.0"]}


def rl_command(algorithm, model_dir, workdir, base_url, iterations: int = 2, eval_tasks: int = 0) -> list:
    """`python -m steprl_jax.main` for online RL at test sizes (2 queries per iteration, n = 4
    (Tree-GRPO: 2 trees of 2 leaves), 12 new tokens, 2 steps, a checkpoint every iteration), on the
    tool world (3 tools) or, for a method of another format, that format's arithmetic config; the verdict
    endpoint at `base_url` judges every outcome; a held-out evaluation of `eval_tasks` queries (0:
    none) every 2 iterations."""
    import sys

    from steprl_jax.algorithms.base import get_algorithm

    action_format = get_algorithm(algorithm).formats[0]
    return [sys.executable, "-m", "steprl_jax.main", f"--config={FORMAT_CONFIGS[action_format]}",
            f"--config.algorithm={algorithm}", f"--config.model.source={model_dir}", f"--config.workdir={workdir}",
            "--config.progress=False", "--config.task.num_tasks=4", "--config.rollout.max_new_tokens=12",
            "--config.rollout.max_steps=2", "--config.rollout.max_context=2048", "--config.rollout.tree.n=4",
            "--config.rollout.temperature=1.0", f"--config.rl.iterations={iterations}",
            "--config.rl.queries_per_iteration=2", "--config.rl.eval_every=2",
            f"--config.rl.eval.num_tasks={eval_tasks}", "--config.rl.eval.votes=1", "--config.rl.arpo.initial=2",
            "--config.rl.dapo.overlong_cache=8", "--config.rl.tree_grpo.n=1", "--config.rl.tree_grpo.keep=2",
            "--config.optimizer.learning_rate=0.001", "--config.judge.outcome.kind=http",
            f"--config.judge.outcome.base_url={base_url}", "--config.judge.outcome.model=stub",
            *FORMAT_FLAGS.get(action_format, [])]


# ------------------------------------------------------------------ driving an environment by hand
def act_written(engine, branch, text: str, finish_reason: str = "stop"):
    """`engine`'s host step on an action written out (as if sampled with log-prob -0.5 a token):
    parse, tool runs, observation and the episode's end, with no model."""
    from steprl_jax.sampling.params import Generation  # on use: importing this module loads no JAX

    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    generation = Generation(tokens=np.asarray(ids, np.int32), logprobs=np.full(len(ids), -0.5, np.float32),
                            finish_reason=finish_reason, text=text, text_after_stop="")
    branch.length += len(ids)
    step = engine._act(branch, generation, 0.0)
    branch.length += len(step.observation_ids)
    return step


def open_branch(engine, task):
    """A fresh branch of `task` at the end of its prompt, and the prompt's ids."""
    from steprl_jax.agents.rollout import Branch

    _, ids = engine.prompt(task)
    return Branch(task, 0, [], [], len(ids)), ids
