"""Shared set-up of the SWiRL tests (test helper): the SmolLM2 tokenizer (cheap, from the preset's
GGUF metadata), tiny random models with its vocabulary, tiny configs, hand-built units and a stub
reward-model endpoint on 127.0.0.1 whose GOOD/BAD depends only on the request (deterministic across
processes, so a random model's stage 2 has non-zero advantages and the resume test is not vacuous)."""
import functools
import hashlib
import json

from chat_stub import ChatStub
from ml_collections import ConfigDict

from steprl_jax.data.units import Unit


@functools.lru_cache(maxsize=None)
def smol_tokenizer():
    from steprl_jax.models.gguf_io import read_gguf_tokenizer
    from steprl_jax.models.pretrained import resolve_source

    return read_gguf_tokenizer(resolve_source("smollm2-135m-instruct"))


def tiny_model(tokenizer, seed: int = 0, **overrides):
    """A 2-layer random llama with the tokenizer's vocabulary (its <|im_end|> ends a turn)."""
    from flax import nnx

    from steprl_jax.models import ModelConfig, Transformer

    settings = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=16, max_position_embeddings=2048,
                    eos_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    settings.update(overrides)
    return Transformer(ModelConfig.tiny("llama", **settings), rngs=nnx.Rngs(seed))


def tiny_config(workdir, reward_url: str = "", **swirl_train):
    """configs/swirl_arithmetic.py at test sizes: 2 train and 2 held-out questions, K=2, G=2,
    2 updates of 2 states, 16 new tokens, 2 steps, filter "none" (a random model's steps are BAD)."""
    from configs import swirl_arithmetic

    c = swirl_arithmetic.get_config()
    c.workdir = str(workdir)
    c.progress = False
    c.task.num_tasks = 2
    c.task.eval_num_tasks = 2
    c.rollout.max_new_tokens = 16
    c.rollout.max_steps = 2
    c.rollout.max_context = 1024
    c.swirl.samples_per_question = 2
    c.swirl.filter = "none"
    c.swirl.train.group_size = 2
    c.swirl.train.batch_size = 2
    c.swirl.train.updates = 2
    c.swirl.train.save_every = 1
    for key, value in swirl_train.items():
        setattr(c.swirl.train, key, value)
    c.swirl.sft.batch_size = 2
    c.swirl.sft.epochs = 1
    c.optimizer.learning_rate = 1e-3  # large enough that stale parameters would show in the ratio
    c.optimizer.max_grad_norm = 0.0
    if reward_url:
        c.reward = reward_config(reward_url)
    return c


def reward_config(base_url: str, **overrides) -> ConfigDict:
    """An http reward model at `base_url` (graded: the stub's scores vary within a group)."""
    settings = dict(kind="http", scale="graded", base_url=base_url, model="stub", timeout_s=10.0, retries=0,
                    backoff_s=0.01, max_backoff_s=0.02)
    settings.update(overrides)
    return ConfigDict(settings)


def prompt_ids(config, tokenizer, question: str) -> list:
    """The rollout engine's prompt for `question` under `config` (chat template, worked examples)."""
    from steprl_jax.agents.environments import Task
    from steprl_jax.agents.tasks import build_suite
    from steprl_jax.models import chat

    env = build_suite(config, split="train").env
    text = chat.apply_chat(tokenizer, env.messages(Task("q", question)), tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hand_units(config, tokenizer) -> list:
    """Two trajectories of two tag actions each on the configured training questions, as units."""
    from steprl_jax.agents.tasks import build_suite

    tasks = build_suite(config, split="train").tasks
    units = []
    for t, task in enumerate(tasks[:2]):
        state = prompt_ids(config, tokenizer, task.question)
        history = ""
        for i, (action, observation) in enumerate([("<math_exp>12 + 7</math_exp>", "\n12 + 7 -> 19\n"),
                                                   ("<answer>19</answer>", "")]):
            action_ids = tokenizer.encode(action, add_special_tokens=False)
            units.append(Unit(trajectory_id=f"{task.id}#{t}", query_id=task.id, step_index=i, question=task.question,
                              history_text=history, action_text=action, state_ids=tuple(state),
                              action_ids=tuple(action_ids), action_logprobs=tuple([-1.0] * len(action_ids))))
            state = state + action_ids + tokenizer.encode(observation, add_special_tokens=False)
            history += action + observation
    return units


def graded_reply(body: dict) -> str:
    """"Score: N", N in 0..10 from a hash of the messages (so of the action they show)."""
    text = json.dumps(body["messages"], sort_keys=True)
    return f"Score: {hashlib.sha256(text.encode()).digest()[0] % 11}"


def RewardServer(reply=graded_reply):
    """The stub endpoint answering `reply(body)` to every choice; `.requests` holds the bodies."""
    return ChatStub(lambda body, i: reply(body))


def unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CALCULATOR_ACTION = "<math_exp>12+7</math_exp>"


def chain_model(tokenizer, text: str = CALCULATOR_ACTION, seed: int = 1):
    """A tiny model that, after a newline (how every state ends), writes `text` and nothing else:
    a bigram table in the weights (layers' outputs zeroed, one embedding direction per token of
    the chain, the output row of each token's successor along it). Its stage-2 samples are
    complete tool calls, so a stage 2 that ran tools would run one."""
    import jax.numpy as jnp
    import numpy as np

    ids = [tokenizer.encode("\n", add_special_tokens=False)[-1]] + tokenizer.encode(text, add_special_tokens=False)
    model = tiny_model(tokenizer, seed=seed, tie_embeddings=False)
    successor = {}
    for a, b in zip(ids[:-1], ids[1:]):
        if successor.setdefault(a, b) != b:
            raise ValueError(f"{text!r}: token {a} has two successors; not a bigram chain")
    dims = {t: i for i, t in enumerate(dict.fromkeys(ids))}
    hidden = model.config.hidden_size
    if len(dims) > hidden:
        raise ValueError("the chain has more distinct tokens than hidden dimensions")
    rng = np.random.default_rng(seed)
    embed = 0.02 * rng.standard_normal((model.config.vocab_size, hidden)).astype(np.float32)
    head = 0.02 * rng.standard_normal((model.config.vocab_size, hidden)).astype(np.float32)
    for token, dim in dims.items():
        embed[token] = 0.0
        embed[token, dim] = 1.0
    for a, b in successor.items():
        head[b, dims[a]] = 10.0  # logit ~ 10 * sqrt(hidden) for the successor, ~0.1 for the rest
    model.embed.set_value(jnp.asarray(embed))
    model.lm_head.set_value(jnp.asarray(head))
    model.layers.o.set_value(jnp.zeros_like(model.layers.o.get_value()))
    model.layers.down.set_value(jnp.zeros_like(model.layers.down.get_value()))
    return model


# configs/swirl_arithmetic.py's `reward` has only kind and scale, so an http reward model cannot be
# set from the command line; this config adds the http keys and changes nothing else.
HTTP_REWARD_CONFIG = '''
from ml_collections import ConfigDict

from configs import swirl_arithmetic


def get_config(arg=None):
    c = swirl_arithmetic.get_config()
    c.reward = ConfigDict(dict(kind="http", scale="graded", base_url="", model="stub", timeout_s=10.0, retries=0,
                               backoff_s=0.01, max_backoff_s=0.02))
    return c
'''


def stage2_command(config_path, model_dir, workdir, base_url, updates: int) -> list:
    """`python -m steprl_jax.main` for SWiRL stage 2 alone at test sizes (2 states of G = 2 per
    update, a checkpoint every update) on the units of filter "none", `config_path` holding
    HTTP_REWARD_CONFIG, the reward model at `base_url`."""
    import sys

    return [sys.executable, "-m", "steprl_jax.main", f"--config={config_path}", f"--config.model.source={model_dir}",
            f"--config.workdir={workdir}", "--config.stages=train", f"--config.reward.base_url={base_url}",
            "--config.task.num_tasks=2", "--config.rollout.max_new_tokens=16", "--config.rollout.max_steps=2",
            "--config.swirl.filter=none", "--config.swirl.train.group_size=2", "--config.swirl.train.batch_size=2",
            f"--config.swirl.train.updates={updates}", "--config.swirl.train.save_every=1",
            "--config.optimizer.learning_rate=0.001", "--config.progress=False"]
