"""The rollout engine: many episodes at once, tools between jitted generation calls.

Each episode is a row of the sampler's KV cache. Actions are parsed; the tool calls of
all episodes run concurrently on a thread pool; each episode's observation tokens are
appended to its cache row (continue, never re-prefill) as soon as its own tools are
done, so a slow tool delays only its own episode.

Continuous batching (`RolloutConfig.continuous`, the default for `run`): the decode loop
returns control every `decode_chunk` tokens and whenever a row finishes its action; that
row's tools start at once while the other rows go on decoding, rows back from their tools
join the next chunk mid-flight, and the row of an episode that ended takes the next
waiting episode (its prompt prefilled on its own and inserted into the running cache). So
no row idles until the slowest action of a batch is done. Otherwise (`continuous=False`)
`run` takes `batch_size` episodes at a time, each generation call running until all its
rows stop. Sampling randomness is per episode: the action of episode i at step s uses the
key fold_in(fold_in(run key, i), s) in both modes, so what an episode samples depends on
its key and context, not on how it was scheduled — up to float rounding: its logits differ in
their last bits with its batch-mates (the batch width, which cache slots hold its keys), and now
and then a draw near a token boundary flips. So a collection that must resume exactly runs in
waves (`run_in_waves`): an interrupted wave is run again whole, with the same batch-mates.

Rollout schedules (agents/schedules: PORTool's trees, ARPO's entropy branching, ...) drive the
same machinery: a branch is a cache row, and a fork copies rows of the cache (`Sampler.fork`),
so a shared prefix is computed once; the engine's public steps (`open_trees`, `fork`,
`relayout`, `generate_and_act`, `append_observations`, `add_nodes`) are what a schedule uses.

Records are token-exact (agents/records.py): the ids and log-probs the sampler
returned, and the observation ids exactly as appended.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Collection, Iterator, Optional, Sequence

import jax
import numpy as np

from steprl_jax.agents.environments import MAX_RESULT_CHARS, Task, clip_result
from steprl_jax.agents.records import Step, TreeNode, TreeRecord, Trajectory
from steprl_jax.sampling.sampler import ContextOverflowError
from steprl_jax.training.host_memory import Trimmer

log = logging.getLogger(__name__)

# `run_in_waves`: batches of episodes per wave. Larger waves keep rows busier (a wave's last
# episodes end with rows idle); smaller ones redo less after an interruption.
WAVE_BATCHES = 8


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_steps: int = 5
    max_new_tokens: int = 128
    max_context: int = 2048
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 16
    tool_workers: int = 16
    with_entropy: bool = False  # record per-token entropies (ARPO branches on them)
    max_result_chars: int = MAX_RESULT_CHARS  # longer tool results reach the agent cut, with a marker
    # Rows whose tools finish within this window after the first one join the same generation call.
    coalesce_s: float = 0.02
    # Wait for every tool call of a generation call before the next one, so that which rows decode
    # together (and so every logit, to the last bit) depends on the tools' results only, never on
    # their timing: runs, and resumed runs, are exactly reproducible. False lets the other rows
    # decode while slow tools (seconds each) run.
    deterministic: bool = True
    continuous: bool = True  # `run`: continuous batching (see the module docstring)
    decode_chunk: int = 16  # continuous: decode steps per generation call at most


@dataclasses.dataclass
class RolloutStats:
    """Where the time and the tokens go."""

    generate_s: float = 0.0
    append_s: float = 0.0
    prefill_s: float = 0.0
    tool_wait_s: float = 0.0
    prefill_tokens: int = 0
    appended_tokens: int = 0
    generated_tokens: int = 0
    generate_calls: int = 0
    forks: int = 0
    inserts: int = 0  # continuous: episodes started in rows freed by others
    shrinks: int = 0  # continuous: the cache narrowed to its live rows once nothing waits to start

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Branch:
    """Host-side state of one cache row: an episode, or a branch of a tree."""

    task: Task
    row: int
    steps: list  # list[Step] on this branch's path
    node_ids: list  # tree node index of each step (trees only)
    length: int  # tokens in the row's context (prompt + steps)
    tree: int = 0  # index of the branch's tree in its batch (trees only; a query may appear twice)
    subtree: int = 0  # a chain started from the prompt: which of its query's search trees it starts
    entropy0: Optional[float] = None  # ARPO: normalised entropy of the first action on this path
    done: bool = False
    termination: str = ""
    final_answer: Optional[str] = None
    future: Optional[concurrent.futures.Future] = None
    key: Optional[np.ndarray] = None  # the episode's key (`run`); None: keys split per call (trees)
    episode: int = -1  # continuous: the episode's index in `run`'s input
    partial: Optional[object] = None  # continuous: the action being generated (a `running` Generation)
    generate_s: float = 0.0  # continuous: this action's share of the generation calls so far


class RolloutEngine:
    """Runs episodes of `env` with `sampler` (steprl_jax.sampling.Sampler)."""

    def __init__(self, sampler, tokenizer, env, config: RolloutConfig, seed: int = 0):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.env = env
        self.config = config
        self.key = jax.random.PRNGKey(seed)
        self.stats = RolloutStats()
        self._trim_heap = Trimmer()
        self._max_context = min(config.max_context, getattr(sampler, "max_context", config.max_context))
        self._pool = concurrent.futures.ThreadPoolExecutor(config.tool_workers, thread_name_prefix="episode")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------------- prompts
    def prompt(self, task: Task) -> tuple[str, list[int]]:
        from steprl_jax.models import chat

        text = chat.apply_chat(self.tokenizer, self.env.messages(task), tools=self.env.tool_schemas(task),
                               tokenize=False)
        # The template wrote every special token it wants (as apply_chat's own tokenize path does).
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------ trajectories
    def run(self, episodes: Sequence[tuple[str, Task]], indices: Optional[Sequence[int]] = None,
            run_key=None) -> Iterator[Trajectory]:
        """Yield one Trajectory per (episode id, task). Continuous (the default): at most
        `config.batch_size` at once, each yielded as it ends (so not in input order); otherwise
        in batches of `config.batch_size`, in order. `indices`: each episode's index for its key
        (default 0, 1, ...): a process running its share of a larger run passes the global ones,
        and samples what the whole run would have sampled for those episodes (up to rounding: see
        the module docstring). `run_key`: the key the episodes' keys fold from (default: the
        engine's next)."""
        if run_key is None:
            self.key, run_key = jax.random.split(self.key)
        indices = np.arange(len(episodes)) if indices is None else np.asarray(indices)
        if len(indices) != len(episodes):
            raise ValueError(f"run: {len(indices)} indices for {len(episodes)} episodes")
        keys = _fold_each(np.broadcast_to(np.asarray(run_key, np.uint32), (len(episodes), 2)),
                          indices.astype(np.uint32)) if episodes else np.zeros((0, 2), np.uint32)
        keys = np.asarray(keys)
        if self.config.continuous:
            yield from self._run_continuous(episodes, keys)
            return
        for start in range(0, len(episodes), self.config.batch_size):
            yield from self._run_batch(episodes[start:start + self.config.batch_size],
                                       keys[start:start + self.config.batch_size])

    def run_in_waves(self, episodes: Sequence[tuple[str, Task]], done: Collection[str],
                     wave: Optional[int] = None) -> Iterator[Trajectory]:
        """`run` over `episodes` in waves of `wave` episodes (default `WAVE_BATCHES` batches),
        yielding those whose id is not in `done`. A wave with anything left runs again whole, done
        episodes included, with the keys of an uninterrupted run: what a resumed collection adds
        is then exactly what the uninterrupted one sampled (an episode's numbers depend in their
        last bits on its batch-mates). Waves already done are skipped; at most one wave is redone."""
        wave = wave or WAVE_BATCHES * self.config.batch_size
        self.key, run_key = jax.random.split(self.key)  # the key one `run` over everything takes
        for start in range(0, len(episodes), wave):
            indices = list(range(start, min(start + wave, len(episodes))))
            if all(episodes[i][0] in done for i in indices):
                continue
            for trajectory in self.run([episodes[i] for i in indices], indices=indices, run_key=run_key):
                if trajectory.id not in done:
                    yield trajectory

    def prefill(self, prompt_ids: list):
        t0 = time.perf_counter()
        state = self.sampler.prefill(prompt_ids)
        jax.block_until_ready(state.cache)  # so that the prefill is timed as prefill
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefill_tokens += sum(len(ids) for ids in prompt_ids)
        return state

    def _run_batch(self, episodes, keys) -> list[Trajectory]:
        prompts = [self.prompt(task) for _, task in episodes]
        state = self.prefill([ids for _, ids in prompts])
        branches = [Branch(task, i, [], [], len(ids), key=key)
                    for i, ((_, task), (_, ids), key) in enumerate(zip(episodes, prompts, keys))]
        self._drive(state, branches)
        out = [_trajectory(episode, prompt, branch) for episode, prompt, branch in zip(episodes, prompts, branches)]
        for task in {task.id: task for _, task in episodes}.values():
            self.env.release(task)
        return out

    def _run_continuous(self, episodes, keys) -> Iterator[Trajectory]:
        """Continuous batching over `config.batch_size` cache rows (see the module docstring)."""
        c = self.config
        queue = collections.deque(range(len(episodes)))
        left_of_task = collections.Counter(task.id for _, task in episodes)  # release a task after its last
        rows: list[Optional[Branch]] = []  # the branch on each cache row; None: free
        prompts: dict = {}  # episode index -> (text, ids)
        state, waiting, admit = None, [], True

        def start(i, row):
            prompts[i] = self.prompt(episodes[i][1])
            if len(prompts[i][1]) > self._max_context:
                raise ContextOverflowError(f"episode {episodes[i][0]!r}: its prompt has {len(prompts[i][1])} tokens, "
                                           f"more than the context limit {self._max_context}")
            return Branch(episodes[i][1], row, [], [], len(prompts[i][1]), key=keys[i], episode=i)

        def end(branches):  # free their rows; release a task after its last episode
            nonlocal state, admit
            state = self.sampler.clear(state, [b.row for b in branches])
            admit = True
            out = []
            for b in branches:
                rows[b.row] = None
                out.append(_trajectory(episodes[b.episode], prompts.pop(b.episode), b))
                left_of_task[b.task.id] -= 1
                if not left_of_task[b.task.id]:
                    self.env.release(b.task)
            return out

        try:
            while queue or any(b is not None for b in rows):
                if not queue and state is not None:
                    state, rows = self._shrink(state, rows)
                free = [r for r, b in enumerate(rows) if b is None]
                if queue and admit and (state is None or free):
                    take = [queue.popleft() for _ in range(min(len(queue), c.batch_size if state is None else len(free)))]
                    new = [start(i, row) for i, row in zip(take, free if state is not None else range(len(take)))]
                    if state is None:
                        first = [prompts[b.episode][1] for b in new]
                        state, rows = self.prefill(first), new  # a shared prompt prefix: held once, later ones start on it
                    else:
                        try:
                            state = self._insert(state, [b.row for b in new], [prompts[b.episode][1] for b in new])
                            for b in new:
                                rows[b.row] = b
                        except ContextOverflowError:  # the cache is full: wait until an episode ends
                            if not any(b is not None for b in rows):
                                raise
                            queue.extendleft(reversed(take))
                            admit = False
                generating = [b for b in rows if b is not None and b.future is None and not b.done]
                if generating:
                    state = self._generate_chunk(state, generating)
                    waiting += [b for b in generating if b.future is not None]
                if not waiting:
                    continue
                if c.deterministic or not any(b is not None and b.future is None and not b.done for b in rows):
                    self._wait_for_tools(waiting)  # (or nothing to decode until a tool returns)
                finished, waiting = _split_done(waiting)
                if not finished:
                    continue
                for b in finished:
                    b.future.result()  # re-raise a bug in host code here, not silently
                # Episodes that ended with this action leave first: their slots are free for the appends.
                yield from end([b for b in finished if b.done])
                pending = [b for b in finished if not b.done]
                if pending:
                    state = self.append_observations(state, pending, [b for b in rows if b is not None],
                                                      renumber=False)
                    yield from end([b for b in pending if b.done])  # observations that did not fit
        finally:
            for task in {episodes[i][1].id: episodes[i][1] for i in prompts}.values():
                self.env.release(task)  # episodes in flight when the consumer stopped

    def _shrink(self, state, rows: list):
        """(state, rows) narrowed to the live rows when they fit in half the batch bucket: with no
        episode left to start, ended episodes' rows would otherwise be decoded to the end with the
        slowest one (each step reads every row's cache). Nothing is recomputed (`Sampler.fork`)."""
        live = [r for r, b in enumerate(rows) if b is not None]
        if not live or self.sampler.batch_bucket(len(live)) * 2 > state.batch_bucket:
            return state, rows
        state = self.sampler.fork(state, live)
        rows = [rows[r] for r in live]
        for row, branch in enumerate(rows):
            branch.row = row
        self.stats.shrinks += 1
        return state, rows

    def _insert(self, state, rows: list[int], prompt_ids: list):
        t0 = time.perf_counter()
        state = self.sampler.insert(state, rows, prompt_ids)
        jax.block_until_ready(state.cache)  # so that the prefill is timed as prefill
        self.stats.prefill_s += time.perf_counter() - t0
        # tokens of the shared segment were computed once, before: not counted again
        shared = state.shared_length
        on_it = [shared and len(p) > shared and list(p[:shared]) == state.shared_ids.tolist() for p in prompt_ids]
        self.stats.prefill_tokens += sum(len(ids) - shared * bool(on) for ids, on in zip(prompt_ids, on_it))
        self.stats.inserts += len(rows)
        return state

    def _generate_chunk(self, state, rows: list[Branch]):
        """Continuous: up to `decode_chunk` tokens for `rows` (others untouched), returning early when
        one of them finishes its action; finished actions go to the pool, the others stay partial."""
        c = self.config
        max_new = np.zeros(state.num_rows, np.int64)
        max_new[[b.row for b in rows]] = c.max_new_tokens
        running = [None] * state.num_rows
        for b in rows:
            running[b.row] = b.partial
        t0 = time.perf_counter()
        state, generations = self.sampler.generate(
            state, self._row_keys(state, rows), max_new_tokens=max_new, params=self._params(), stop=self.env.stop_strings,
            running=running, max_steps=c.decode_chunk, return_on_finish=True)
        elapsed = time.perf_counter() - t0
        self._count_generate(elapsed)
        for branch in rows:
            generation = generations[branch.row]
            branch.generate_s += elapsed / len(rows)
            if generation.finish_reason == "running":
                branch.partial = generation
                continue
            branch.partial = None
            self._dispatch(branch, generation, branch.generate_s)
            branch.generate_s = 0.0
        return state

    def _drive(self, state, branches: list[Branch]) -> None:
        """Step all branches to the end: generate for ready rows, act on the host, append observations."""
        ready = [b for b in branches if not b.done]
        waiting: list[Branch] = []
        while ready or waiting:
            if ready:
                state = self.generate_and_act(state, ready)
                waiting += [b for b in ready if b.future is not None]
                ready = []
            if waiting:
                self._wait_for_tools(waiting)
                finished, waiting = _split_done(waiting)
                state = self.append_observations(state, finished, branches)
                ready = [b for b in finished if not b.done]
        return state

    def _wait_for_tools(self, waiting: list[Branch]) -> None:
        """Block until the tools of `waiting` return: all of them (`deterministic`), or the first
        and those within `coalesce_s` of it (which ones is up to timing)."""
        t0 = time.perf_counter()
        if self.config.deterministic:
            concurrent.futures.wait([b.future for b in waiting])
        else:
            concurrent.futures.wait([b.future for b in waiting], return_when=concurrent.futures.FIRST_COMPLETED)
            time.sleep(self.config.coalesce_s)  # let near-simultaneous tools join the next call
        self.stats.tool_wait_s += time.perf_counter() - t0

    def generate_and_act(self, state, rows: list[Branch], with_entropy: bool = False):
        """One jitted generation call for `rows` (other rows untouched), then their host work on the pool;
        `with_entropy` records the per-token entropies whatever the config says."""
        if all(b.key is not None for b in rows):
            key = self._row_keys(state, rows)
        else:
            self.key, key = jax.random.split(self.key)
        max_new = np.zeros(state.num_rows, np.int64)
        max_new[[b.row for b in rows]] = self.config.max_new_tokens
        t0 = time.perf_counter()
        state, generations = self.sampler.generate(state, key, max_new_tokens=max_new,
                                                   params=self._params(with_entropy), stop=self.env.stop_strings)
        elapsed = time.perf_counter() - t0
        self._count_generate(elapsed)
        for branch in rows:
            self._dispatch(branch, generations[branch.row], elapsed / max(1, len(rows)))
        return state

    def _count_generate(self, elapsed: float) -> None:
        self.stats.generate_s += elapsed
        self.stats.generate_calls += 1
        self._trim_heap()  # every chunk frees cache-sized buffers (training/host_memory.py)

    def _params(self, with_entropy: bool = False):
        from steprl_jax.sampling import SamplingParams

        c = self.config
        return SamplingParams(temperature=c.temperature if c.temperature > 0 else 1.0, top_k=c.top_k,
                              top_p=c.top_p, greedy=c.temperature <= 0, with_entropy=c.with_entropy or with_entropy)

    def _row_keys(self, state, rows: list[Branch]):
        """One key per row of `state` (on the device): fold_in(episode key, step index) for `rows`,
        unused ones elsewhere. Folded over every row, so one program per batch size, not per
        number of generating rows, and no round trip through the host."""
        keys = np.zeros((state.num_rows, 2), np.uint32)
        steps = np.zeros(state.num_rows, np.uint32)
        for b in rows:
            keys[b.row], steps[b.row] = b.key, len(b.steps)
        return _fold_each(keys, steps)

    def _dispatch(self, branch: Branch, generation, generate_s: float) -> None:
        """A finished action: count it and hand its host work (parse, tools) to the pool."""
        self.stats.generated_tokens += len(generation.tokens)
        branch.length += len(generation.tokens)
        branch.future = self._pool.submit(self._act, branch, generation, generate_s)

    def _act(self, branch: Branch, generation, generate_s: float) -> Step:
        """Host work for one action: parse, run its tools, build the observation. Never raises."""
        env, task = self.env, branch.task
        # The text of exactly the sampled tokens (a token may carry a little past the stop string).
        action_text = (generation.text or "") + generation.text_after_stop
        parsed = env.parse(action_text)
        calls = env.calls_for(parsed)
        budget = getattr(env, "max_tool_calls", None)
        if budget is not None:  # the episode's calls so far count against it; `outcome` sees fewer results
            calls = calls[:max(0, budget - sum(len(s.tool_calls) for s in branch.steps))]
        t0 = time.perf_counter()
        results = env.registry_for(task).execute([c.to_json() for c in calls]) if calls else []
        results = [clip_result(r, self.config.max_result_chars) for r in results]
        tool_s = time.perf_counter() - t0
        outcome = env.outcome(task, parsed, results)
        step = Step(
            action_text=action_text, action_ids=[int(t) for t in generation.tokens],
            action_logprobs=[float(x) for x in generation.logprobs],
            observation_text=outcome.observation_text,
            observation_ids=env.observation_ids(self.tokenizer, outcome.observation_text),
            tool_calls=[c.to_json() for c in outcome.calls], tool_results=[r.to_json() for r in outcome.results],
            kind=outcome.kind, format_problems=list(outcome.problems), format_checks=dict(outcome.format_checks),
            finish_reason=generation.finish_reason,
            action_entropies=None if generation.entropies is None else [float(x) for x in generation.entropies],
            generate_s=generate_s, tool_s=tool_s, action_versions=versions_of(generation))
        branch.steps.append(step)
        self._settle(branch, step, outcome.final_answer, outcome.ends_episode)
        return step

    def _settle(self, branch: Branch, step: Step, final_answer: Optional[str], ends: bool = False) -> None:
        """Decide whether the branch ends after `step`, and why."""
        if final_answer is not None:
            branch.done, branch.termination, branch.final_answer = True, "answer", final_answer
        elif step.finish_reason == "context":
            branch.done, branch.termination = True, "context"
        elif ends:  # the environment ends the episode without a final answer
            branch.done, branch.termination = True, "no_answer"
        elif step.kind == "invalid" and self.env.invalid_action == "end":
            branch.done, branch.termination = True, "unparseable"
        elif len(branch.steps) >= self.config.max_steps:
            branch.done, branch.termination = True, "step_cap"
        elif branch.length + len(step.observation_ids) + self.config.max_new_tokens > self._max_context:
            branch.done, branch.termination = True, "context"

    def append_observations(self, state, branches: list[Branch], in_state: list[Branch], renumber: bool = True):
        """Append the last observation of each of `branches` to its row; `in_state`: every branch
        holding a row of `state`.

        All rows share cache slot indices, so an append is bounded by the longest row in the state,
        finished rows included. When it does not fit, the finished rows are dropped (live rows
        renumbered; with `renumber=False` the caller has cleared them already) and it is tried
        again; a branch whose observation still does not fit ends with termination "context",
        like one whose generation does not fit.
        """
        pending = []
        for branch in branches:
            branch.future.result()  # re-raise a bug in host code here, not silently
            branch.future = None
            if not branch.done:
                pending.append(branch)
        while pending:
            try:
                return self._append(state, pending)
            except ContextOverflowError:  # raised before any computation: `state` is intact
                pass
            live = [b for b in in_state if not b.done]
            if renumber and len(live) < state.num_rows:
                state = self.fork(state, [b.row for b in live])
                for row, branch in enumerate(live):
                    branch.row = row
                continue
            # An append needs as many slots as its longest observation: end the longest ones first.
            longest = max(len(b.steps[-1].observation_ids) for b in pending)
            for branch in pending:
                if len(branch.steps[-1].observation_ids) == longest:
                    branch.done, branch.termination = True, "context"
            pending = [b for b in pending if not b.done]
        return state

    def _append(self, state, branches: list[Branch]):
        tokens = [[] for _ in range(state.num_rows)]
        for branch in branches:
            tokens[branch.row] = branch.steps[-1].observation_ids
        appended = sum(len(ids) for ids in tokens)
        if appended:
            t0 = time.perf_counter()
            state = self.sampler.append(state, tokens)
            self.stats.append_s += time.perf_counter() - t0
            self.stats.appended_tokens += appended
        for branch in branches:
            branch.length += len(branch.steps[-1].observation_ids)
        return state

    # ------------------------------------------------------------------ trees (agents/schedules)
    def open_trees(self, items: Sequence[tuple[str, Task]], metadata=None):
        """(state, records, roots) for a batch of trees: the prompts prefilled one row each, an empty
        TreeRecord per (tree id, task) with `metadata(task)` (default the task's own), and the branch
        on each prompt row (`Branch.tree` = its index in the batch)."""
        prompts = [self.prompt(task) for _, task in items]
        state = self.prefill([ids for _, ids in prompts])
        records = [TreeRecord(tree_id, task.id, task.question, text, ids, reference_answer=task.reference,
                              metadata=dict(task.metadata) if metadata is None else metadata(task))
                   for (tree_id, task), (text, ids) in zip(items, prompts)]
        roots = [Branch(task, i, [], [], len(ids), tree=i) for i, ((_, task), (_, ids)) in enumerate(zip(items, prompts))]
        return state, records, roots

    def release(self, items: Sequence[tuple[str, Task]]) -> None:
        """The tasks' environment state (e.g. a sandbox) is no longer needed."""
        for _, task in items:
            self.env.release(task)

    def relayout(self, state, holders: list[Branch]):
        """A state whose row i is the current row of `holders[i]` (rows repeat or drop); renumbers them.
        With no holders (the batch is done) the state is left as it is."""
        if not holders:
            return state
        state = self.fork(state, [b.row for b in holders])
        for row, b in enumerate(holders):
            b.row = row
        return state

    def fork(self, state, rows: list[int]):
        if rows == list(range(len(rows))) and len(rows) == state.num_rows:
            return state
        self.stats.forks += 1
        return self.sampler.fork(state, rows)


def _split_done(waiting: list[Branch]) -> tuple[list, list]:
    """(branches whose tools are done, the others), from one look at each future."""
    done = [b.future.done() for b in waiting]
    return [b for b, d in zip(waiting, done) if d], [b for b, d in zip(waiting, done) if not d]


@jax.jit
def _fold_each(keys, data):
    """fold_in(keys[i], data[i]) for each i: [n, 2] uint32 keys, [n] integers."""
    return jax.vmap(jax.random.fold_in)(keys, data)


def _trajectory(episode: tuple, prompt: tuple, branch: Branch) -> Trajectory:
    (episode_id, task), (text, ids) = episode, prompt
    return Trajectory(id=episode_id, query_id=task.id, question=task.question, prompt_text=text, prompt_ids=ids,
                      steps=branch.steps, reference_answer=task.reference, final_answer=branch.final_answer,
                      termination=branch.termination, metadata=dict(task.metadata))


def copy_branch(branch: Branch) -> Branch:
    """A new branch on the same row and path (the path lists are its own)."""
    return dataclasses.replace(branch, steps=list(branch.steps), node_ids=list(branch.node_ids))


def add_nodes(records: list[TreeRecord], branches: list[Branch]) -> None:
    """Each branch's newest step becomes a node of its tree (a child of its previous step); a branch
    that is done (settled by `_act`, or by an observation that did not fit) ends at a leaf."""
    for branch in branches:
        record = records[branch.tree]
        parent_node = branch.node_ids[-1] if branch.node_ids else -1
        subtree = record.nodes[parent_node].subtree if parent_node >= 0 else branch.subtree
        record.nodes.append(TreeNode(parent=parent_node, step=branch.steps[-1], depth=len(branch.steps),
                                     subtree=subtree))
        branch.node_ids.append(len(record.nodes) - 1)
        if branch.done:
            record.leaf_terminations[str(branch.node_ids[-1])] = branch.termination
            record.leaf_answers[str(branch.node_ids[-1])] = branch.final_answer


def prune_dead_ends(record: TreeRecord) -> TreeRecord:
    """Drop steps that lead to no finished trajectory (branches the resample schedule stopped)."""
    terminal = {int(k) for k in record.leaf_terminations}
    keep = set()
    for leaf in terminal:
        keep.update(record.path(leaf))
    if len(keep) == len(record.nodes):
        return record
    new_index = {old: new for new, old in enumerate(sorted(keep))}
    nodes = [dataclasses.replace(n, parent=new_index.get(n.parent, -1))
             for old, n in enumerate(record.nodes) if old in keep]
    remap = lambda d: {str(new_index[int(k)]): v for k, v in d.items() if int(k) in new_index}
    return dataclasses.replace(record, nodes=nodes, leaf_terminations=remap(record.leaf_terminations),
                               leaf_answers=remap(record.leaf_answers), leaf_outcomes=remap(record.leaf_outcomes))


def versions_of(generation) -> Optional[list[int]]:
    """A generation's per-token policy versions as a record keeps them (`Step.action_versions`)."""
    return None if generation.versions is None else [int(v) for v in generation.versions]
