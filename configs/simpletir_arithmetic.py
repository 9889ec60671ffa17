"""SimpleTIR on the built-in arithmetic: SmolLM2-135M-Instruct reasons in turns that end at the
first complete ```python block, the Python sandbox runs it (final_answer(x) prints \\boxed{x}), the
output continues the turn; the answer in \\boxed{} is checked by math-verify (1 / 0), and GRPO trains
on the response with void-turn trajectories masked and uninformative groups re-sampled
(algorithms/simpletir.py). Sizes fit a 2-core CPU.

    python -m steprl_jax.main --config=configs/simpletir_arithmetic.py
    python -m steprl_jax.main --config=configs/simpletir_arithmetic.py --config.task.name=gsm8k \\
        --config.task.path=../shared/data/gsm8k/train.jsonl --config.task.eval_path=../shared/data/gsm8k/test_1000.jsonl

SimpleTIR's own run (README, train.sh): Qwen2.5-7B, 512 queries x 16 responses, at most 5 turns,
8,000 tokens per turn and 16,000 in all, temperature 1, lr 1e-6, grad clip 1, 2-3x oversampling.
"""
from configs import torl_arithmetic


def get_config(arg=None):
    c = torl_arithmetic.get_config()  # the same task, sandbox, sizes and optimizer; SimpleTIR's format
    c.algorithm = "simpletir"
    c.workdir = "runs/simpletir_arithmetic"
    c.env.format = "code_turns"
    c.env.few_shot = 0  # SimpleTIR's prompt carries its own example
    del c.env.max_tool_calls  # ToRL's per-response budget: a SimpleTIR turn runs one block
    # The sandbox: wall clock (SimpleTIR: 3 s) and CPU seconds per run (the policy sees at most 256 +
    # 256 characters of the output).
    c.env.python.wall_timeout_s, c.env.python.cpu_s = 3.0, 3
    c.rollout.max_steps = 5  # turns (SimpleTIR trains with 5), of at most rollout.max_new_tokens each
    return c
