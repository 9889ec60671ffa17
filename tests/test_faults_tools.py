"""Tool faults under load: a 64-episode rollout whose calculator raises, hangs and floods.

The real rollout engine (continuous batching, the sampler's KV cache, tools on threads with time
limits, token-exact records) runs a tiny model whose weights make it write
`<math_exp>12+7</math_exp>` after every newline (a bigram chain, as `swirl_helpers.chain_model`,
built here from zeros so that it costs no initialisation): every action of every episode is a
complete tool call, so all 64 x 3 actions reach the tools without a scripted policy. (A random
tiny model almost never closes a tag, and SmolLM2 with few-shot prompts would cost minutes for
192 actions on a CPU.) The tokenizer is byte-level with the two tags as tokens of their own.

The calculator is wrapped by a seeded fault injector registered in the tool registry: per call,
10% raise, 5% hang (until the run is over, far past their 2 s limit) and 5% return 10 MB.
"""
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest

from configs import demo
from steprl_jax.agents.environments import TaggedEnv, Task
from steprl_jax.agents.records import RecordStore
from steprl_jax.agents.rollout import RolloutEngine
from steprl_jax.agents.tasks import rollout_config
from steprl_jax.tools.calculator import calculator_tool
from steprl_jax.tools.protocol import Tool, object_schema
from steprl_jax.tools.registry import ToolRegistry

EPISODES, STEPS = 64, 3
RATES = {"raise": 0.10, "hang": 0.05, "huge": 0.05}  # the rest answer normally
HUGE_CHARS = 10_000_000  # 10 MB of ASCII
TIMEOUT_S = 2.0  # a healthy call takes ~1 ms; on a busy 2-core machine one took over 0.3 s
HANG_S = 300.0  # a hung call returns after this long, so that a run waiting for one fails the test, not hangs it
CAP = 64  # rollout.max_result_chars
ACTION = "<math_exp>12+7</math_exp>"


def tag_tokenizer():
    """The byte-level ChatML tokenizer with the calculator tags as single tokens (so that the
    action is a chain of distinct tokens)."""
    from steprl_jax.models.chat import byte_level_tokenizer

    return byte_level_tokenizer(extra_tokens=("<math_exp>", "</math_exp>"))


def chain_policy(tokenizer, text: str):
    """A 2-layer llama that, after a newline, writes `text` (greedy): the layers' weights are zero,
    so each position's logits depend on its own token only (one embedding direction per token of
    the chain, the output row of its successor along it)."""
    import jax
    from flax import nnx

    from steprl_jax.models import ModelConfig, Transformer

    config = ModelConfig.tiny("llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=2048,
                              tie_embeddings=False, eos_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    arrays = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), state)
    ids = tokenizer.encode("\n" + text, add_special_tokens=False)
    assert len(set(ids)) == len(ids), "the chain must not repeat a token"
    arrays["final_norm"].get_value()[:] = 1.0
    for dim, (token, successor) in enumerate(zip(ids[:-1], ids[1:])):
        arrays["embed"].get_value()[token, dim] = 1.0
        arrays["lm_head"].get_value()[successor, dim] = 10.0
    return nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, arrays))


class FaultInjector:
    """Wraps a tool: each call draws its fate from one seeded stream (in call order) and logs it."""

    def __init__(self, rates: dict, seed: int):
        self.rates = rates
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.log: list[str] = []  # the fate of call i
        self.release = threading.Event()  # hung calls return once this is set, or after HANG_S
        self.hanging = 0  # hung calls not yet returned

    def _draw(self) -> tuple[int, str]:
        with self._lock:
            u, kind, edge = self._rng.random(), "ok", 0.0
            for name, rate in self.rates.items():
                edge += rate
                if u < edge:
                    kind = name
                    break
            self.log.append(kind)
            if kind == "hang":
                self.hanging += 1
            return len(self.log) - 1, kind

    def wrap(self, tool: Tool, timeout_s: float) -> Tool:
        def fn(**arguments):
            index, kind = self._draw()
            if kind == "raise":
                raise RuntimeError(f"injected fault #{index}")
            if kind == "hang":
                self.release.wait(HANG_S)
                with self._lock:
                    self.hanging -= 1
                return "too late"
            content = tool.fn(**arguments)
            return f"#{index} " + "9" * HUGE_CHARS if kind == "huge" else content

        return Tool(tool.name, tool.description, tool.parameters, fn, timeout_s=timeout_s)

    def counts(self) -> dict:
        with self._lock:
            return {kind: self.log.count(kind) for kind in ("ok", *self.rates)}


def _fate(result: dict) -> str:
    """What the agent was shown: ok, truncated, or the error type."""
    if "error" in result:
        return result["error"]["type"]
    return "truncated" if "[truncated:" in result["content"] else "ok"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from steprl_jax.sampling import Sampler

    tokenizer = tag_tokenizer()
    injector = FaultInjector(RATES, seed=7)
    env = TaggedEnv(ToolRegistry([injector.wrap(calculator_tool(), TIMEOUT_S)]),
                    system_prompt="Solve with <math_exp>EXPRESSION</math_exp>.")
    settings = demo.get_config()  # the cap on a result is a config field like any rollout setting
    settings.rollout.update(max_steps=STEPS, max_new_tokens=16, max_context=1024, temperature=0.0,
                            batch_size=EPISODES, max_result_chars=CAP)
    config = rollout_config(settings)
    engine = RolloutEngine(Sampler(chain_policy(tokenizer, ACTION), tokenizer, max_context=1024), tokenizer, env,
                           config)
    store = RecordStore(tmp_path_factory.mktemp("faults") / "trajectories.jsonl")
    episodes = [(f"e{i}", Task(f"q{i}", f"What is 12 + 7? (#{i})", "19")) for i in range(EPISODES)]
    try:
        for trajectory in engine.run(episodes):
            store.append(trajectory)
        hung_when_the_run_ended = injector.hanging  # read before the hung calls are let go
    finally:
        injector.release.set()
        engine.close()
    return dict(injector=injector, store=store, episodes=episodes, hung_when_the_run_ended=hung_when_the_run_ended)


def test_every_episode_finishes_with_every_call_made(run):
    records = run["store"].load()
    assert sorted(r.id for r in records) == sorted(i for i, _ in run["episodes"])  # none lost, none twice
    for record in records:
        assert record.termination == "step_cap", record.id
        assert [s.kind for s in record.steps] == ["math"] * STEPS
        assert all(s.action_text == ACTION for s in record.steps)
    assert len(run["injector"].log) == EPISODES * STEPS


def test_each_fault_is_an_error_observation_in_the_records(run):
    injector, records = run["injector"], run["store"].load()
    injected = injector.counts()
    print("injected:", injected)
    assert all(injected[kind] > 0 for kind in RATES)
    seen = {"ok": 0, "tool_failure": 0, "timeout": 0, "truncated": 0}
    for step in (s for r in records for s in r.steps):
        (result,) = step.tool_results
        fate = _fate(result)
        seen[fate] += 1
        if fate == "tool_failure":  # the exception's text, with the call it came from
            message = result["error"]["message"]
            index = int(message.rsplit("#", 1)[1])
            assert message == f"RuntimeError: injected fault #{index}" and injector.log[index] == "raise"
            assert f"Error (tool_failure): {message}" in step.observation_text
        elif fate == "timeout":
            assert result["error"]["message"] == f"the call did not finish within {TIMEOUT_S:g} s"
            assert "Error (timeout)" in step.observation_text  # the timeout path's own message, not a clock
        elif fate == "truncated":
            content = result["content"]
            index = int(content[1:content.index(" ")])
            assert injector.log[index] == "huge"
            assert content.endswith(f"... [truncated: {HUGE_CHARS + len(f'#{index} ') - CAP} more characters]")
            assert len(step.observation_text) < CAP + 100 and "[truncated:" in step.observation_text
        else:
            assert result["content"] == "19"
    assert seen == {"ok": injected["ok"], "tool_failure": injected["raise"], "timeout": injected["hang"],
                    "truncated": injected["huge"]}


def test_records_stay_small(run):
    path = run["store"].path
    with open(path, encoding="utf-8") as f:
        longest = max(len(line) for line in f)
    print(f"records: {os.path.getsize(path)} bytes, longest line {longest}")
    assert os.path.getsize(path) < 2_000_000  # one 10 MB result alone would be 10 MB
    assert longest < 50_000


def test_hung_calls_never_blocked_the_run(run):
    """No step waited for a hung call: every call that hung was still hung when the last episode
    ended (a hung call returns only once the run is over, or after HANG_S), and each one is its
    step's timeout. No clock decides it; how long a batch with hung calls takes against its limit
    is measured by `python -m steprl_jax.benchmarks.tool_timeouts`."""
    hangs = run["injector"].counts()["hang"]
    timed_out = [step for record in run["store"].load() for step in record.steps
                 if any("error" in r and r["error"]["type"] == "timeout" for r in step.tool_results)]
    assert hangs > 0 and len(timed_out) == hangs
    assert run["hung_when_the_run_ended"] == hangs


# ------------------------------------------------------------------ the registry on its own
def _hang_tool(release: threading.Event, timeout_s: float = 0.2) -> Tool:
    return Tool("hang", "never answers in time", object_schema({}), lambda: release.wait() and "late",
                timeout_s=timeout_s)


def test_more_hung_calls_than_workers_do_not_starve_later_calls():
    """A hung call gives its slot back when it is abandoned: after 3 hung calls on 2 workers a
    healthy call still runs (a fixed pool of 2 would report it as a timeout without running it)."""
    release = threading.Event()
    registry = ToolRegistry([_hang_tool(release), calculator_tool()], max_workers=2)
    try:
        hung = registry.execute([{"name": "hang", "arguments": {}}] * 3)
        assert [r.error_type for r in hung] == ["timeout"] * 3
        again = registry.execute([{"name": "calculator", "arguments": {"expression": "12+7"}}] * 2)
        assert [r.content for r in again] == ["19", "19"]
    finally:
        release.set()


def test_a_tool_that_hangs_for_good_leaks_at_most_max_hung_threads():
    """Past `max_hung` abandoned calls still alive, a tool's calls are answered with a timeout at once,
    without a thread; other tools still run; once the hung ones return, the tool runs again."""
    release = threading.Event()
    calls = []  # every call the tool's function starts

    def hang():
        calls.append(1)
        return release.wait() and "late"

    stuck = Tool("stuck", "never answers in time", object_schema({}), hang, timeout_s=0.1)
    registry = ToolRegistry([stuck, calculator_tool()], max_workers=2, max_hung=3)

    def alive() -> int:
        return sum(t.name == "tool-stuck" for t in threading.enumerate())

    try:
        for _ in range(3):
            assert registry.execute_one({"name": "stuck", "arguments": {}}).error_type == "timeout"
        assert registry.hung_calls == {"stuck": 3} and alive() == 3
        refused = registry.execute([{"name": "stuck", "arguments": {}}] * 5)
        assert len(calls) == 3  # answered without starting the calls (no wait for their time limit)
        assert [r.error_type for r in refused] == ["timeout"] * 5
        message = refused[0].to_json()["error"]["message"]
        assert "too many calls of this tool are still hung (3 " in message, message
        assert registry.hung_calls == {"stuck": 3} and alive() == 3  # no thread was started
        assert registry.execute_one({"name": "calculator", "arguments": {"expression": "12+7"}}).content == "19"
    finally:
        release.set()
    for thread in [t for t in threading.enumerate() if t.name == "tool-stuck"]:
        thread.join()  # a call's thread takes it off the hung count before it ends: no clock needed
    assert registry.hung_calls == {}
    assert registry.execute_one({"name": "stuck", "arguments": {}}).content == "late"  # it runs again


def test_a_hung_call_does_not_keep_the_process_alive():
    code = ("import threading\n"
            "from steprl_jax.tools.protocol import Tool, object_schema\n"
            "from steprl_jax.tools.registry import ToolRegistry\n"
            "tool = Tool('hang', 'never returns', object_schema({}), lambda: threading.Event().wait(), timeout_s=0.1)\n"
            "print(ToolRegistry([tool]).execute_one({'name': 'hang', 'arguments': {}}).error_type)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "timeout", out.stderr


def test_the_timeout_benchmark_runs_and_checks_what_it_times():
    """`benchmarks.tool_timeouts` on a small batch: its hung calls get `timeout` results from the
    registry and stay unanswered in the bare pool (both checked inside); no time is asserted."""
    from steprl_jax.benchmarks import tool_timeouts

    out = tool_timeouts.measure(calls=4, hung=1, limit=0.05, repeats=1)
    assert len(out["rows"]) == 1 and out["ours_over_bare"] > 0 and out["ours_over_limit"] > 0
    with pytest.raises(ValueError, match="--hung"):
        tool_timeouts.measure(calls=4, hung=4, limit=0.05, repeats=1)
