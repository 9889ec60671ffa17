"""A built-in, seeded set of short arithmetic word problems (one to three calculator steps).

It lets the embedded default run with no data files; GSM8K replaces it when a path
is given. Every problem carries its gold calculator steps, so expert demonstrations
can be rendered in SWiRL's tag format.
"""
from __future__ import annotations

import dataclasses
import random

from steprl_jax.data.demonstrations import Demonstration, tagged_demonstration
from steprl_jax.tools.calculator import calculate


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    id: str
    question: str
    answer: str
    steps: tuple[str, ...]  # gold calculator expressions, in order

    def demonstration(self) -> Demonstration:
        return tagged_demonstration(self.question, [("math", e, calculate(e)) for e in self.steps], self.answer)


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


def arithmetic_problems(n: int = 32, seed: int = 0) -> list[ArithmeticProblem]:
    """`n` problems, the same for the same seed."""
    rng = random.Random(seed)
    templates = _templates()
    problems = []
    for i in range(n):
        template, expressions = templates[i % len(templates)]
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        c = rng.randint(a * b, a * b + 40) if "spends" in template else rng.randint(1, a * b)
        values = dict(a=a, b=b, c=c, a_times_b=a * b, c_small=min(c, a * b) // 3, name=rng.choice(_NAMES))
        steps = tuple(expressions(a, b, c))
        answer = calculate(steps[-1])
        problems.append(ArithmeticProblem(f"arith-{seed}-{i}", template.format(**values), answer, steps))
    return problems
