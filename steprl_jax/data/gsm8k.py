"""GSM8K: question, final answer after `####`, and the calculator steps of `<<expr=value>>`."""
from __future__ import annotations

import dataclasses
import os
import re

from steprl_jax.data.arithmetic import python_printed
from steprl_jax.data.demonstrations import (
    Demonstration, code_demonstration, code_turns_demonstration, flow_planner_demonstration, tagged_demonstration)
from steprl_jax.io import DataFormatError, LoadReport, load_records, require
from steprl_jax.tools.calculator import calculate
from steprl_jax.tools.protocol import ToolError

_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


@dataclasses.dataclass(frozen=True)
class GSM8KProblem:
    question: str
    solution: str
    answer: str
    steps: tuple[tuple[str, str], ...]  # (expression, annotated value)

    def demonstration(self) -> Demonstration:
        """SWiRL format: one `<math_exp>` per gold step (results from our calculator), then `<answer>`."""
        rendered = []
        for expression, value in self.steps:
            try:
                result = calculate(expression)
            except ToolError:
                result = value  # the dataset's own value when the expression is not plain arithmetic
            rendered.append(("math", expression, result))
        return tagged_demonstration(self.question, rendered, self.answer)

    def code_demonstration(self) -> Demonstration:
        """ToRL's code format: one block printing every gold step (ValueError when a step is not
        plain arithmetic: `arithmetic.python_printed`)."""
        expressions = [e for e, _ in self.steps]
        return code_demonstration(self.question, expressions, [python_printed(e) for e in expressions], self.answer)

    def code_turns_demonstration(self) -> Demonstration:
        """SimpleTIR's multi-turn code format, the same steps."""
        expressions = [e for e, _ in self.steps]
        return code_turns_demonstration(self.question, expressions, [python_printed(e) for e in expressions],
                                        self.answer)

    def flow_demonstration(self, tool_name: str) -> Demonstration:
        """AgentFlow's planner handing the same steps to the python tool (ValueError as above)."""
        expressions = [e for e, _ in self.steps]
        for e in expressions:
            python_printed(e)
        return flow_planner_demonstration(self.question, expressions, tool_name)

    def solution_quantities(self) -> tuple[str, ...]:
        """Every quantity the reference solution computes: each `<<expression=value>>`'s annotated
        value, and our calculator's exact value where the two differ (`<<10/3=3.33>>`), then the
        final answer."""
        out = []
        for expression, value in self.steps:
            out.append(value)
            try:
                out.append(calculate(expression))
            except ToolError:  # not plain arithmetic: the annotation alone
                pass
        return tuple(dict.fromkeys(out + [self.answer]))


def parse_gsm8k_record(record, where: str) -> GSM8KProblem:
    question = require(record, "question", str, where)
    solution = require(record, "answer", str, where)
    if "####" not in solution:
        raise DataFormatError(f"{where}: field 'answer' has no '#### final answer' line")
    body, final = solution.rsplit("####", 1)
    final = final.strip().replace(",", "")
    if not final:
        raise DataFormatError(f"{where}: field 'answer' has an empty final answer after '####'")
    steps = tuple((expr.strip(), value.strip()) for expr, value in _ANNOTATION.findall(body))
    return GSM8KProblem(question, solution, final, steps)


def load_gsm8k(path: str | os.PathLike, skip_malformed: bool = False,
               report: LoadReport | None = None) -> list[GSM8KProblem]:
    return load_records(path, parse_gsm8k_record, skip_malformed, report)
