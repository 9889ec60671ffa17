"""SimpleTIR: the code_turns format (tools/code_turns.py), its two-part stop in the byte automaton
(sampling/stop.py), its environment run by the rollout engine with the real Python sandbox
(agents/code_env.py `CodeTurnsEnv`), the simpletir method's builder, group filter and loss, the
online loop's format check and one online iteration on a tiny random policy.

Turns are written by hand and tokenised with SmolLM2's tokenizer, then handed to the rollout
engine's host step (`RolloutEngine._act`) as the sampler would hand them over; nothing is stubbed."""
import json

import numpy as np
import pytest

from steprl_jax.agents.code_env import CODE_BLOCK_STOP, CodeTurnsEnv, render_run, response_answer
from steprl_jax.agents.environments import Task
from steprl_jax.agents.records import Step, TreeRecord, Trajectory
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.algorithms import online
from steprl_jax.algorithms.base import get_algorithm
from steprl_jax.algorithms.tree_rows import leaf_rows
from steprl_jax.sampling.stop import TwoPartStop, first_stop, stop_transition_table, token_transition_table
from steprl_jax.tools import code_turns
from steprl_jax.tools.python_sandbox import SandboxSettings, python_tool
from steprl_jax.tools.registry import ToolRegistry
from rl_helpers import act_written, open_branch
from swirl_helpers import smol_tokenizer, tiny_model

STOP = CODE_BLOCK_STOP


# ---- parsing -------------------------------------------------------------------------------------
def test_a_turn_is_cut_at_the_end_of_its_first_complete_block():
    text = "Let me compute.\n```python\nprint(6 * 12)\n```\nand more\n```py\nprint(2)\n```"
    turn = code_turns.parse_turn(text)
    assert turn.code == "print(6 * 12)" and text[:turn.end] == "Let me compute.\n```python\nprint(6 * 12)\n```"
    assert not turn.boxed and not turn.void
    # ``` and ```py open a block too (SimpleTIR's prompt shows ```py); the code is stripped
    assert code_turns.parse_turn("```\n  x = 1\nprint(x)  \n```").code == "x = 1\nprint(x)"
    assert code_turns.parse_turn("```py\nfinal_answer(3)\n```").code == "final_answer(3)"
    # an unfinished block is no block
    assert code_turns.parse_turn("```python\nprint(1)\n").code is None


def test_void_turns_and_box_marks():
    assert code_turns.parse_turn("I think about it some more").void
    assert code_turns.parse_turn("```python\nprint(1)").void  # cut by the token cap inside the block
    assert code_turns.parse_turn(None).void
    answer = code_turns.parse_turn("So it is \\boxed{72}.")
    assert answer.boxed and answer.code is None and not answer.void
    # "\boxed{" counts up to the block's end only: text after the cut is not the turn's
    both = code_turns.parse_turn("\\boxed{1}\n```python\nprint(1)\n```")
    assert both.boxed and both.code == "print(1)"
    assert not code_turns.parse_turn("```python\nprint(1)\n```\n\\boxed{1}").boxed
    assert code_turns.parse_turn("\\boxed{7").boxed  # the mark, as SimpleTIR checks it, not a whole box


def test_outputs_are_shown_by_simpletir_rules():
    assert code_turns.render_result("42\n", "") == "\nCode execution result: 42\n\n"
    assert code_turns.render_result("", "") == ""
    # stderr: its last line replaces stdout
    assert code_turns.render_result("partial\n", "Traceback\n  line 2\nZeroDivisionError: division by zero") == \
        "\nCode execution result: ZeroDivisionError: division by zero\n"
    long = "".join(str(i % 10) for i in range(600))
    shown = code_turns.truncate_content(long)
    assert shown == (long[:256] + "\n..._This content has been truncated to stay below 512 characters_...\n"
                     + long[-256:])
    assert code_turns.truncate_content("x" * 512) == "x" * 512
    assert code_turns.snippet("final_answer(3)") == \
        '\ndef final_answer(result):\n    print(f"\\\\boxed{{{result}}}")\nfinal_answer(3)'


# ---- the two-part stop -------------------------------------------------------------------------
def _stop_at(table, tokens):
    """The index of the token at which the table stops, or None."""
    state = 0
    for i, t in enumerate(tokens):
        state = table[state, t]
        if state < 0:
            return i
    return None


@pytest.fixture(scope="module")
def tokenizer():
    return smol_tokenizer()


def test_the_opening_fence_does_not_stop_the_closing_one_does(tokenizer):
    from steprl_jax.sampling.stop import token_bytes_table

    vocab = token_bytes_table(tokenizer)
    table = stop_transition_table([STOP], vocab, 32)
    text = "Compute:\n```python\nprint(6 * 12)\n```\nThen"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [vocab[t] for t in ids]
    assert b"".join(pieces) == text.encode()
    at = _stop_at(table, ids)
    ends = np.cumsum([len(p) for p in pieces])
    cut = text.index("\n```\n") + 4  # just after the closing fence
    assert at is not None and ends[at] >= cut and (at == 0 or ends[at - 1] < cut)
    assert _stop_at(table, tokenizer.encode("```python\nprint(1)", add_special_tokens=False)) is None
    # the plain closing fence alone (no block opened) does not stop, nor does ``` inside a line
    assert _stop_at(table, tokenizer.encode("Use ``` fences.\n```\n", add_special_tokens=False)) is None
    # one byte per token: the fences split over many tokens stop at exactly the last backtick
    single = {bytes([b]): i for i, b in enumerate(range(256))}
    byte_table = stop_transition_table([STOP], [bytes([b]) for b in range(256)], 32)
    raw = text.encode()
    assert _stop_at(byte_table, [single[raw[i:i + 1]] for i in range(len(raw))]) == cut - 1
    assert first_stop(text, [STOP]) == (cut, "\n```")


def test_the_two_part_stop_is_exact_on_random_token_sequences():
    """Tokens of 1-3 bytes from the fences' alphabet: the table stops at the first token whose
    bytes complete SimpleTIR's first code block (its regex's first match), never before."""
    rng = np.random.default_rng(0)
    alphabet = list(b"`\npyx")
    tokens = [bytes(rng.choice(alphabet, size=rng.integers(1, 4))) for _ in range(40)]
    tokens += [b"```", b"python", b"py", b"\n", b"``", b"`", b"x", b"\n``", b"thon\n", b"```\n", b"x\n"] * 3
    table = stop_transition_table([STOP], tokens, 32)
    stops = 0
    for _ in range(1000):
        seq = rng.integers(0, len(tokens), size=int(rng.integers(4, 24)))
        text = b"".join(tokens[t] for t in seq).decode()
        match = code_turns.CODE_BLOCK.search(text)
        at = _stop_at(table, seq)
        if match is None:
            assert at is None, text
            continue
        stops += 1
        ends = np.cumsum([len(tokens[t]) for t in seq])
        assert at == int(np.searchsorted(ends, match.end(), side="left")), text
        assert first_stop(text, [STOP])[0] == match.end()
    assert stops > 80, stops  # the comparison saw many blocks, not only texts without one


def test_plain_stop_tables_are_unchanged_and_a_two_part_stop_comes_alone():
    tokens = [b"</", b"answer", b">", b"x"]
    plain = stop_transition_table(["</answer>"], tokens, 16)
    assert (plain == token_transition_table([b"</answer>"], tokens, 16)).all()
    with pytest.raises(ValueError, match="two-part stop must be the only stop"):
        stop_transition_table([STOP, "</answer>"], tokens, 64)
    with pytest.raises(ValueError, match="close must be a non-empty string"):
        TwoPartStop(("```",), "")
    with pytest.raises(ValueError, match="opens must be non-empty strings"):
        TwoPartStop("```", "\n```")  # a string is not a tuple of opens
    assert TwoPartStop(["a", "b"], "c") == TwoPartStop(("a", "b"), "c")  # a list becomes a (hashable) tuple
    assert len({TwoPartStop(["a"], "c"), TwoPartStop(("a",), "c")}) == 1


# ---- the environment in the rollout engine, with the real sandbox --------------------------------
TASK = Task("q0", "What is 6 times 12?", "72")


def _engine(tokenizer, max_steps=5, wall_timeout_s=2.0):
    settings = SandboxSettings(wall_timeout_s=wall_timeout_s, cpu_s=2)
    env = CodeTurnsEnv(ToolRegistry([python_tool(settings, render=render_run)]))
    return RolloutEngine(None, tokenizer, env, RolloutConfig(max_steps=max_steps, max_new_tokens=64,
                                                            max_context=4096))


def test_turns_run_their_block_continue_the_turn_and_final_answer_ends_the_episode(tokenizer):
    engine = _engine(tokenizer)
    try:
        branch, prompt_ids = open_branch(engine, TASK)
        assert engine.env.messages(TASK) == [{"role": "user", "content": code_turns_prompt() + TASK.question}]
        first = act_written(engine, branch, "Multiply:\n```python\nprint(6 * 12)\n```")
        assert first.kind == "code" and first.tool_calls[0]["arguments"]["code"] == code_turns.snippet("print(6 * 12)")
        assert first.observation_text == "\nCode execution result: 72\n\n"
        assert first.observation_ids == tokenizer.encode(first.observation_text, add_special_tokens=False)
        assert not branch.done
        error = act_written(engine, branch, "Check:\n```py\nprint(1)\nprint(1 / 0)\n```")
        assert error.observation_text == "\nCode execution result: ZeroDivisionError: division by zero\n"
        assert not branch.done
        last = act_written(engine, branch, "Done:\n```py\nfinal_answer(6 * 12)\nprint('after')\n```")
        assert last.observation_text == "\nCode execution result: \\boxed{72}\nafter\n\n"
        assert branch.done and branch.termination == "answer" and branch.final_answer == "72"

        # the loss mask: the turns train, the outputs do not
        trajectory = Trajectory("e0", TASK.id, TASK.question, "", prompt_ids, branch.steps, TASK.reference,
                                branch.final_answer, branch.termination)
        assert response_answer(trajectory) == "72"
        record = TreeRecord.from_group("t0", [trajectory])
        (row,) = leaf_rows(record, lambda leaf, node: 1.0, agg="token_mean")
        ids, loss = row.flat()[0], np.asarray(row.flat()[1])
        start = len(prompt_ids)
        for step in branch.steps[:-1]:
            for span_ids, trained in ((step.action_ids, True), (step.observation_ids, False)):
                assert ids[start:start + len(span_ids)] == list(span_ids)
                span = loss[start:start + len(span_ids)]
                assert (span > 0).all() if trained else not span.any()
                start += len(span_ids)
        assert (loss[start:start + len(last.action_ids)] > 0).all()
        assert not loss[:len(prompt_ids)].any()
    finally:
        engine.close()


def code_turns_prompt():
    from steprl_jax.agents.code_env import CODE_TURNS_PROMPT

    assert CODE_TURNS_PROMPT.endswith("User Question:\n") and "```py\nanswer = 5 + 3 + 1294.678" in CODE_TURNS_PROMPT
    return CODE_TURNS_PROMPT


def test_a_box_in_the_turn_ends_the_episode_its_code_still_runs(tokenizer):
    engine = _engine(tokenizer)
    try:
        branch, _ = open_branch(engine, TASK)
        step = act_written(engine, branch, "It is \\boxed{72}.\n```python\nprint(72)\n```")
        assert step.kind == "code" and step.observation_text == "\nCode execution result: 72\n\n"
        assert branch.done and branch.termination == "answer" and branch.final_answer == "72"
        plain, _ = open_branch(engine, TASK)
        answer = act_written(engine, plain, "So the answer is \\boxed{72}.", finish_reason="eos")
        assert answer.kind == "answer" and answer.observation_text == "" and plain.final_answer == "72"
    finally:
        engine.close()


@pytest.mark.parametrize("text, finish_reason", [
    ("I keep thinking about the problem", "eos"),
    ("```python\nprint(6 * 12)", "length"),  # the turn's token cap cut the block
])
def test_a_void_turn_ends_the_episode(tokenizer, text, finish_reason):
    engine = _engine(tokenizer)
    try:
        branch, _ = open_branch(engine, TASK)
        act_written(engine, branch, "```python\nprint(1)\n```")
        step = act_written(engine, branch, text, finish_reason=finish_reason)
        assert step.kind == "void" and step.tool_calls == [] and step.observation_text == ""
        assert branch.done and branch.termination == "no_answer" and branch.final_answer is None
    finally:
        engine.close()


def test_a_silent_run_shows_nothing_and_the_turn_cap_ends_the_episode(tokenizer):
    engine = _engine(tokenizer, max_steps=2)
    try:
        branch, _ = open_branch(engine, TASK)
        step = act_written(engine, branch, "```python\nx = 1\n```")
        assert step.kind == "code" and step.observation_text == "" and not branch.done
        act_written(engine, branch, "```python\nprint(2)\n```")
        assert branch.done and branch.termination == "step_cap"
    finally:
        engine.close()


# ---- the method ----------------------------------------------------------------------------------
def _config(tmp_path):
    from configs import simpletir_arithmetic

    c = simpletir_arithmetic.get_config()
    c.workdir = str(tmp_path)
    c.progress = False
    c.task.num_tasks = 4
    c.env.python.wall_timeout_s = 2.0
    c.rollout.max_new_tokens = 12
    c.rollout.max_steps = 2
    c.rollout.max_context = 512
    c.rollout.tree.n = 2
    c.rl.iterations = 1
    c.rl.queries_per_iteration = 2
    c.rl.eval.num_tasks = 0
    c.rl.simpletir.max_sampling_rounds = 2
    c.rl.skip_update_without_signal = False
    c.optimizer.learning_rate = 1e-3
    return c


def _group(outcomes, void=(), truncated=()):
    """A group of trajectories: a code turn (2 tokens, 1 output token) then a last turn (1 token),
    void for the indices in `void`, cut at the token cap for those in `truncated`."""
    trajectories = []
    for i in range(len(outcomes)):
        last = Step("b", [4], [0.0], kind="void" if i in void else "answer",
                    finish_reason="length" if i in truncated else "eos")
        steps = [Step("a", [1, 2], [0.0, 0.0], observation_text="o", observation_ids=[3], kind="code"), last]
        trajectories.append(Trajectory(f"e{i}", "q", "q", "", [9, 9], steps, "72"))
    record = TreeRecord.from_group("t", trajectories)
    record.leaf_outcomes = {str(leaf): r for leaf, r in zip(record.leaves(), outcomes)}
    return record


def test_void_trajectories_train_nothing_but_count_in_their_group_z_score(tmp_path):
    simpletir = get_algorithm("simpletir")
    settings = simpletir.read(_config(tmp_path))
    # R_out +1 / -1 / -1 / +1 -> rewards 1, 0, 0, 1; trajectory 2 (index 1) has a void turn
    record = _group((1.0, -1.0, -1.0, 1.0), void=(1,))
    rows, metrics = simpletir.build([record], settings)
    # mean 0.5, sample std (ddof 1) sqrt(1/3): advantages +-0.5 / (0.57735 + 1e-6), all four counted
    adv = 0.5 / (np.sqrt(1 / 3) + 1e-6)
    trained = [(w, a) for row in rows for w, a in zip(row.flat()[1], row.flat()[3]) if w > 0]
    assert len(trained) == 3 * 3 and {w for w, _ in trained} == {1.0}  # 3 trajectories x 3 action tokens
    assert sorted(a for _, a in trained) == pytest.approx([-adv] * 3 + [adv] * 6)
    assert metrics["reward"] == 0.5 and metrics["masked_trajectories"] == 1.0
    # the void trajectory's tokens are in the rows, untrained (context only)
    flat_ids = [i for row in rows for i in row.flat()[0]]
    assert flat_ids.count(4) == 4
    # without the masking it trains like the others
    unmasked = simpletir.build([record], settings.__class__(**{**settings.__dict__, "mask_void_turns": False}))
    assert len([w for row in unmasked[0] for w in row.flat()[1] if w > 0]) == 4 * 3


def test_groups_without_signal_or_all_truncated_are_dropped(tmp_path):
    simpletir = get_algorithm("simpletir")
    settings = simpletir.read(_config(tmp_path))
    assert not simpletir.keep(_group((1.0, 1.0, 1.0, 1.0)), settings)  # std 0
    assert not simpletir.keep(_group((-1.0, -1.0, 0.0, -1.0)), settings)  # all 0 after the 1/0 mapping
    assert not simpletir.keep(_group((1.0, -1.0, -1.0, 1.0), truncated=(0, 1, 2, 3)), settings)
    assert simpletir.keep(_group((1.0, -1.0, -1.0, 1.0), truncated=(0, 1, 2)), settings)
    assert simpletir.keep(_group((1.0, -1.0, -1.0, -1.0)), settings)
    assert simpletir.sampling_rounds(settings) == 2


def test_the_loss_clips_higher_with_a_dual_clip_and_no_kl(tmp_path):
    c = _config(tmp_path)
    settings = online.read_settings(c)
    loss = settings.learner.loss
    assert settings.algorithm.name == "simpletir"
    assert (loss.eps_low, loss.eps_high, loss.dual_clip, loss.kl_coef, loss.entropy_coef) == (0.2, 0.28, 3.0, 0.0, 0.0)
    assert loss.agg == "token_mean" and settings.method.agg == "token_mean"
    c.env.format = "tool_call"
    refused = r"config.env.format: simpletir trains on the code_turns format; got 'tool_call'"
    with pytest.raises(ValueError, match=refused):
        online.read_settings(c)
    c = _config(tmp_path)
    c.rl.simpletir.dual_clip = 1.0
    with pytest.raises(ValueError, match=r"config.rl.simpletir.dual_clip must be > 1"):
        online.read_settings(c)


def test_the_code_turns_format_needs_the_python_tool_and_no_few_shot(tmp_path):
    from steprl_jax.agents.tasks import build_suite

    c = _config(tmp_path)
    c.env.tools = ("calculator",)
    with pytest.raises(ValueError, match=r"config.env.tools: the code_turns format runs \('python',\)"):
        build_suite(c)
    c = _config(tmp_path)
    c.env.few_shot = 1
    with pytest.raises(ValueError, match="config.env.few_shot: the code_turns format shows no worked examples"):
        build_suite(c)
    c = _config(tmp_path)
    c.task.name = "toolworld"
    with pytest.raises(ValueError, match="config.env.format: the code_turns format runs the math tasks"):
        build_suite(c)
    assert isinstance(build_suite(_config(tmp_path)).env, CodeTurnsEnv)


def test_one_online_iteration_of_simpletir(tmp_path):
    """The random policy's turns are void and cut at the token cap, and none is right: every group
    is dropped, and re-sampled for a second round."""
    from steprl_jax import config_schema
    from steprl_jax.training.metrics_log import read_metrics

    c = _config(tmp_path)
    c.rl.eval.num_tasks = 2  # the held-out evaluation runs and judges the code_turns format too
    config_schema.check(c)
    tokenizer = smol_tokenizer()
    summary = online.run(c, (tiny_model(tokenizer), tokenizer))
    assert summary["algorithm"] == "simpletir"
    row = read_metrics(str(tmp_path))["rl"][0]
    assert row["sampling_rounds"] == 2 and row["groups_dropped"] == 4 and row["leaves"] == 8
    assert row["queries_kept"] == 0 and row["skipped"] == 1  # nothing left to train on
    with open(tmp_path / "rollouts" / "iter_00000.jsonl") as f:
        trees = [json.loads(line) for line in f]
    assert len(trees) == 4
    assert all(v["label"] == "false" for t in trees for v in t["leaf_verdicts"].values())
    # each episode is one void turn (sampled with the two-part stop, which random text never hits)
    steps = [n["step"] for t in trees for n in t["nodes"]]
    assert all(step["kind"] == "void" and step["finish_reason"] == "length" for step in steps)
    assert all(v == "no_answer" for t in trees for v in t["leaf_terminations"].values())
    with open(tmp_path / "eval" / "iter_00001.metrics.json") as f:
        ci = json.load(f)["ci"]
    assert ci["accuracy"]["value"] == 0.0 and ci["accuracy"]["n"] == 2
