"""A built-in, seeded set of short arithmetic word problems (one to three calculator steps).

It lets the embedded default run with no data files; GSM8K replaces it when a path
is given. Every problem carries its gold calculator steps, so expert demonstrations
can be rendered in SWiRL's tag format and in the code formats.
"""
from __future__ import annotations

import ast
import dataclasses
import operator
import random

from steprl_jax.data.demonstrations import (
    Demonstration, code_demonstration, code_turns_demonstration, flow_planner_demonstration, tagged_demonstration)
from steprl_jax.tools.calculator import calculate


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    id: str
    question: str
    answer: str
    steps: tuple[str, ...]  # gold calculator expressions, in order

    def demonstration(self) -> Demonstration:
        return tagged_demonstration(self.question, [("math", e, calculate(e)) for e in self.steps], self.answer)

    def code_demonstration(self) -> Demonstration:
        """The same solution in ToRL's code format: one block printing every step."""
        return code_demonstration(self.question, list(self.steps), [python_printed(e) for e in self.steps],
                                  self.answer)

    def code_turns_demonstration(self) -> Demonstration:
        """The same solution in SimpleTIR's multi-turn code format."""
        return code_turns_demonstration(self.question, list(self.steps), [python_printed(e) for e in self.steps],
                                        self.answer)

    def flow_demonstration(self, tool_name: str) -> Demonstration:
        """AgentFlow's planner handing the same steps to the python tool (ValueError as above)."""
        for e in self.steps:
            python_printed(e)
        return flow_planner_demonstration(self.question, list(self.steps), tool_name)

    def solution_quantities(self) -> tuple[str, ...]:
        """The value of every gold step, in order (the last is the answer): what a reference-guided
        step judge accepts a calculator step for computing."""
        return tuple(calculate(e) for e in self.steps)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def python_printed(expression: str) -> str:
    """What `print(expression)` shows for a gold step: number literals with + - * / // % ** and
    brackets, evaluated as Python does (`72 / 8` -> `9.0`). ValueError for anything else (names,
    calls, a division by zero, a power past 10**6 digits' reach) so that no demonstration shows an
    output Python would not print."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else +operand
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError(f"a power too large for a gold step: {expression!r}")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"not a gold arithmetic step: {expression!r}")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ArithmeticError) as e:
        raise ValueError(f"not a gold arithmetic step: {expression!r} ({e})") from None


def _templates():
    """(question template, function of the numbers -> list of expressions; the last gives the answer)."""
    return [
        ("{name} buys {a} packs of pencils with {b} pencils in each pack. How many pencils does {name} have?",
         lambda a, b, c: [f"{a} * {b}"]),
        ("A baker makes {a} loaves a day for {b} days and sells {c} loaves in all. How many loaves are left?",
         lambda a, b, c: [f"{a} * {b}", f"{a * b} - {c}"]),
        ("{name} has {c} dollars and spends {a} dollars on each of {b} books. How much money is left?",
         lambda a, b, c: [f"{a} * {b}", f"{c} - {a * b}"]),
        ("A train travels {a} km every hour. How far does it go in {b} hours and then {c} more km?",
         lambda a, b, c: [f"{a} * {b}", f"{a * b} + {c}"]),
        ("{name} shares {a_times_b} stickers equally among {b} friends. How many stickers does each friend get?",
         lambda a, b, c: [f"{a * b} / {b}"]),
        ("A garden has {a} rows of {b} tulips and {c} roses. How many flowers are in the garden?",
         lambda a, b, c: [f"{a} * {b}", f"{a * b} + {c}"]),
        ("{name} reads {a} pages on Monday, twice as many on Tuesday and {c} pages on Wednesday. "
         "How many pages did {name} read?", lambda a, b, c: [f"{a} * 2", f"{a} + {2 * a} + {c}"]),
        ("A box holds {b} apples. {name} fills {a} boxes and eats {c_small} apples. How many apples remain?",
         lambda a, b, c: [f"{a} * {b}", f"{a * b} - {min(c, a * b) // 3}"]),
        ("Tickets cost {a} dollars for adults and {b} dollars for children. What do 2 adults and {c_small} children pay?",
         lambda a, b, c: [f"2 * {a}", f"{min(c, a * b) // 3} * {b}", f"{2 * a} + {(min(c, a * b) // 3) * b}"]),
    ]


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun")


def arithmetic_problems(n: int = 32, seed: int = 0, templates=None) -> list[ArithmeticProblem]:
    """`n` problems, the same for the same seed; `templates`: indices of the templates to cycle
    through (default all)."""
    rng = random.Random(seed)
    every = _templates()
    chosen = [every[i] for i in (range(len(every)) if templates is None else templates)]
    problems = []
    for i in range(n):
        template, expressions = chosen[i % len(chosen)]
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        c = rng.randint(a * b, a * b + 40) if "spends" in template else rng.randint(1, a * b)
        values = dict(a=a, b=b, c=c, a_times_b=a * b, c_small=min(c, a * b) // 3, name=rng.choice(_NAMES))
        steps = tuple(expressions(a, b, c))
        answer = calculate(steps[-1])
        problems.append(ArithmeticProblem(f"arith-{seed}-{i}", template.format(**values), answer, steps))
    return problems


# Train on the first seven templates; held-out problems also use the last two (never trained on).
TRAIN_TEMPLATES = tuple(range(7))
_SPLIT_SEEDS = {"train": 1_000, "test": 2_000}


def arithmetic_split(split: str, n: int, seed: int = 0) -> list[ArithmeticProblem]:
    """Disjoint splits: `train` (templates 0-6) and `test` (all templates, other numbers); no
    question of one split appears in the other, nor in the worked examples (seed 10_007)."""
    if split not in _SPLIT_SEEDS:
        raise ValueError(f"arithmetic split must be one of {sorted(_SPLIT_SEEDS)}, got {split!r}")
    other = "test" if split == "train" else "train"
    templates = TRAIN_TEMPLATES if split == "train" else None
    excluded = {p.question for p in arithmetic_problems(8, seed=10_007)}
    excluded |= {p.question for p in arithmetic_problems(
        max(4 * n, 256), seed=_SPLIT_SEEDS[other] + seed, templates=TRAIN_TEMPLATES if other == "train" else None)}
    pool = arithmetic_problems(4 * n + 64, seed=_SPLIT_SEEDS[split] + seed, templates=templates)
    kept = [p for p in pool if p.question not in excluded][:n]
    # another seed's problems get other ids: results of two problem sets never pair by id
    return [dataclasses.replace(p, id=f"arith-{split}-{i}" + (f"-s{seed}" if seed else "")) for i, p in enumerate(kept)]
