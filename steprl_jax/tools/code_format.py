"""ToRL's code action format (GAIR-NLP/ToRL): parsing (total, never raises) and rendering.

The policy writes reasoning and a Python block, then asks for its output:

    reasoning ...
    ```python
    print(6 * 7)
    ```
    ```output            <- the stop string: generation stops here and the block runs
    42                   <- the observation, appended to the same assistant turn
    ```
    ... more reasoning, the final answer in \\boxed{42}

An action is what one generation call wrote: it ends at the stop string (a request to run code) or
without it (end of turn or the token cap: the response is over). Only the action's last python block
runs, statelessly, and only when it is complete: a block still open at the stop string (the model was
writing it) runs nothing, even after an earlier complete block, as ToRL's `extract_program` does.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

OUTPUT_STOP = "```output"  # the stop string; it stays in the action (trained, as in ToRL)
OUTPUT_END = "\n```\n"  # closes the output block
CODE_OPEN = "```python"
CODE_CLOSE = "```"
ELIDED_CHARS = 256  # outputs this long or longer are shown as their head and tail, 128 characters each
_HEAD_TAIL = 128
_BOX = re.compile(r"\\boxed\{")
_BRACES = re.compile(r"[{}]")


@dataclasses.dataclass(frozen=True)
class CodeAction:
    """One parsed action. `stopped`: it ended at the stop string; `code`: the last complete python
    block before it (None when there is none, or the last one is unfinished); `after_stop`: text the
    last token carried past the stop string; `answer`: the action's last \\boxed{...} content."""

    stopped: bool
    code: Optional[str]
    after_stop: str
    answer: Optional[str]


def last_python_block(text: str) -> Optional[str]:
    """The last ```python block of `text`, or None when `text` has none or its last one is still open.

    Line by line, as ToRL's `extract_program(last_only=True)`: a line starting or ending with
    ```python opens a block (dropping any earlier one), a line starting with ``` closes it."""
    program: Optional[list[str]] = None
    found: Optional[str] = None
    for line in text.split("\n"):
        if line.startswith(CODE_OPEN) or line.endswith(CODE_OPEN):
            program, found = [], None
        elif program is not None and line.startswith(CODE_CLOSE):
            found, program = "\n".join(program), None
        elif program is not None:
            program.append(line)
    return None if program is not None else found


def last_boxed(text: Any) -> Optional[str]:
    """The content of the last \\boxed{...} of `text` whose braces balance (nested braces kept:
    \\boxed{\\frac{1}{2}} -> \\frac{1}{2}); None when there is none. A box cut off before its
    closing brace is skipped for the last complete one before it. One pass over the braces, so a
    page of unclosed boxes costs no more than its length."""
    if not isinstance(text, str):
        return None
    opens = [m.end() - 1 for m in _BOX.finditer(text)]  # the position of each box's "{"
    if not opens:
        return None
    closing, stack = {}, []
    for brace in _BRACES.finditer(text):
        if brace.group() == "{":
            stack.append(brace.start())
        elif stack:
            closing[stack.pop()] = brace.start()
    for start in reversed(opens):
        if start in closing:
            return text[start + 1:closing[start]]
    return None


def parse_code_action(text: Any) -> CodeAction:
    """The action's stop, code and answer (see `CodeAction`). Non-text is an empty action."""
    if not isinstance(text, str):
        return CodeAction(False, None, "", None)
    at = text.rfind(OUTPUT_STOP)
    if at < 0:
        return CodeAction(False, None, "", last_boxed(text))
    before = text[:at]
    return CodeAction(True, last_python_block(before), text[at + len(OUTPUT_STOP):], last_boxed(before))


def format_output(text: str) -> str:
    """What the policy is shown of a run's output, by ToRL's rules: text containing "Error" is
    reduced to its last line (the exception line); then stripped; 256 characters or more become
    the first 128 + "..." + the last 128.

    ToRL shows an empty output as a timeout ("timeout_decorator...TimeoutError: 'Timed Out'"), so a
    snippet that printed nothing read as one that hung. Here it stays what the tool said:
    the Python tool's "(no output)" (tools/python_sandbox.py `observation`), or empty."""
    text = text or ""
    if "Error" in text:
        text = text.strip().split("\n")[-1]
    text = text.strip()
    if len(text) >= ELIDED_CHARS:
        text = text[:_HEAD_TAIL] + "..." + text[-_HEAD_TAIL:]
    return text


def render_observation(output: str, after_stop: str = "") -> str:
    """The text appended after an action that stopped at ```output: "\\n{output}\\n```\\n", so that
    the turn reads "```output\\n{output}\\n```\\n". Without the leading newline when the action's
    last token already carried one past the stop string."""
    lead = "" if after_stop.endswith("\n") else "\n"
    return f"{lead}{output}{OUTPUT_END}"


def render_code_action(reasoning: str, code: str) -> str:
    """An action that runs `code` (as a demonstration writes it), ending with the stop string."""
    return f"{reasoning}\n{CODE_OPEN}\n{code}\n{CODE_CLOSE}\n{OUTPUT_STOP}"
