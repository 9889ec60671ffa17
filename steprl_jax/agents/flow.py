"""AgentFlow's agent system (Li et al. 2025, arXiv 2510.05592; reference lupantech/AgentFlow,
`agentflow/solver.py`, `models/{planner,executor,verifier,memory}.py`): a trained planner and
frozen modules around it. The rollout that drives them is agents/schedules/flow.py; here are
the pieces: the planner-step parser, the memory and its rendering, the modules' prompts and
parsers, the tools, and the frozen model they call (`FrozenModel`).

Departures from the reference, and why:
* The executor writes the tool's input directly (for `Python_Coder_Tool`: the python code, run in
  our sandbox, tools/python_sandbox.py), not a `tool.execute(query=...)` line whose tool then asks
  another LLM for code: one frozen call instead of two, the same role. `Base_Generator_Tool` takes
  the sub-goal as its command (the frozen model answers it), with no executor call.
* No query-analysis call: the reference's `analyze_query` output goes into every prompt; a small
  frozen model's analysis is noise at our scale, and dropping it keeps the planner's prompt to the
  query, the tools and the memory.
* Memory is rendered one line group per step with each result clipped (the reference prints the
  Python dict repr with results up to 100,000 characters); it is reset for every rollout (the
  reference's cached solver shares one Memory across tasks, which looks unintended).
* The final answer is the last <answer>...</answer> of the solution generator's reply, else its
  last \\boxed{}, else the whole reply (the reference: the tag, else the whole output).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import re
from typing import Optional, Sequence

from steprl_jax.tools import code_format

PYTHON_CODER = "Python_Coder_Tool"
GENERATOR = "Base_Generator_Tool"
TOOLS = {
    PYTHON_CODER: ("Writes and runs Python code for a precise computation and returns what it prints. "
                   "Input: a sub-goal that states the computation (numbers included)."),
    GENERATOR: ("A general language model that answers a self-contained sub-goal in text. "
                "Input: the sub-goal as a question."),
}
# The reference's training suffix on the question (train/rollout.py): every module sees it.
ANSWER_SUFFIX = (" When ready, output the final answer enclosed in <answer> and </answer> tags. "
                 "Do not generate any content after the </answer> tag.")
SYSTEM = "You are a helpful, creative, and smart assistant."  # the reference's vLLM engine default

STOP, CONTINUE = "STOP", "CONTINUE"


# ----------------------------------------------------------------------------- the planner's step
@dataclasses.dataclass(frozen=True)
class PlannerStep:
    """A parsed planner reply. `problem` is None for a usable step, else why it is not one
    ("no_step": no Context / Sub-Goal / Tool Name sections; "unknown_tool": a tool not offered)."""

    justification: str
    context: str
    sub_goal: str
    tool_name: str
    problem: Optional[str] = None


_SECTION = r"\**\s*{}\s*\**\s*:\s*\**"
_STEP = re.compile(_SECTION.format("Context") + r"(.*?)" + _SECTION.format("Sub-?Goal") + r"(.*?)"
                   + _SECTION.format("Tool[ _]?Name") + r"(.*?)(?=(?:\n\s*\**\s*Context\s*\**\s*:)|\Z)",
                   re.IGNORECASE | re.DOTALL)


def _clean(text: str) -> str:
    return text.strip().strip("*").strip()


def normalize_tool_name(name: str) -> str:
    """The reference matches tool names over spaces and underscores; we also ignore case and
    surrounding quotes or backticks."""
    return re.sub(r"[\s_`'\"*]+", "", name).lower()


def parse_planner_step(text: str, tool_names: Sequence[str]) -> PlannerStep:
    """The last Context / Sub-Goal / Tool Name sections of `text` (the reference's regex, last
    match), markdown bold allowed; the tool name is its section's first line, matched leniently."""
    matches = list(_STEP.finditer(text or ""))
    if not matches:
        return PlannerStep(_clean(text or ""), "", "", "", "no_step")
    m = matches[-1]
    justification = re.sub(_SECTION.format("Justification"), "", text[:m.start()], flags=re.IGNORECASE)
    lines = [line for line in m.group(3).strip().splitlines() if line.strip()]
    raw_tool = _clean(lines[0]) if lines else ""
    known = {normalize_tool_name(t): t for t in tool_names}
    tool = known.get(normalize_tool_name(raw_tool))
    return PlannerStep(_clean(justification), _clean(m.group(1)), _clean(m.group(2)), tool or raw_tool,
                       None if tool else "unknown_tool")


# ----------------------------------------------------------------------------- memory
@dataclasses.dataclass(frozen=True)
class MemoryEntry:
    """One earlier step as the reference's memory keeps it (models/memory.py `add_action`)."""

    tool_name: str
    sub_goal: str
    command: str
    result: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def clip_middle(text: str, limit: int) -> str:
    """`text` cut to its head and tail when longer than `limit` characters."""
    if len(text) <= limit:
        return text
    half = max(0, (limit - 5) // 2)
    return text[:half] + " ... " + text[len(text) - half:]


def render_entry(e: MemoryEntry, result_chars: int = 400) -> str:
    """One step of the memory, its command and result clipped to `result_chars` each."""
    return "\n".join([f"  Tool: {e.tool_name}", f"  Sub-Goal: {e.sub_goal}",
                      f"  Command: {clip_middle(e.command, result_chars)}",
                      f"  Result: {clip_middle(e.result, result_chars)}"])


def render_memory(entries: Sequence[MemoryEntry], result_chars: int = 400) -> str:
    """The memory as the planner, verifier and solution generator see it."""
    if not entries:
        return "None"
    return "\n".join(f"Action Step {k}:\n{render_entry(e, result_chars)}" for k, e in enumerate(entries, start=1))


def render_tools(tool_names: Sequence[str]) -> str:
    return "\n".join(f"- {name}: {TOOLS[name]}" for name in tool_names)


# ----------------------------------------------------------------------------- prompts
def _user(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def planner_messages(question: str, tool_names: Sequence[str], memory: str) -> list[dict]:
    """The reference's next-step prompt (planner.py `generate_next_step`, text-only branch), without
    the query analysis and the toolbox metadata (the tool list says what each does)."""
    return _user(
        "Task: Determine the optimal next step to address the query using available tools and previous steps.\n\n"
        f"Context:\n**Query:** {question}{ANSWER_SUFFIX}\n**Available Tools:**\n{render_tools(tool_names)}\n"
        f"**Previous Steps:**\n{memory}\n\n"
        "Instructions: Select the **single best tool** for the next step, and state a specific sub-goal it "
        "can achieve.\n\n"
        "Response Format:\nJustification: why this tool and sub-goal\nContext: the information the tool needs\n"
        "Sub-Goal: what this step achieves\nTool Name: exactly one of the available tools\n\n"
        "The response must end with the Context, Sub-Goal, and Tool Name sections in that order, with no "
        "extra content.")


def executor_messages(question: str, step: PlannerStep) -> list[dict]:
    """The reference's command prompt (executor.py `generate_tool_command`), asking for the code."""
    return _user(
        "Task: Generate precise Python code to achieve the sub-goal.\n\n"
        f"Query: {question}\nSub-Goal: {step.sub_goal}\nRelevant Data: {step.context}\n\n"
        "Write self-contained Python that prints the result. Output:\nGenerated Command:\n```python\n<code>\n```")


def generator_messages(step: PlannerStep) -> list[dict]:
    context = f"\nContext: {step.context}" if step.context else ""
    return _user(f"{step.sub_goal}{context}")


def verifier_messages(question: str, memory: str) -> list[dict]:
    """The reference's verification prompt (verifier.py `verificate_context`)."""
    return _user(
        "Task: Evaluate if the current memory is complete and accurate enough to answer the query, or if "
        "more tools are needed.\n\n"
        f"Query: {question}{ANSWER_SUFFIX}\nMemory (tools used and results):\n{memory}\n\n"
        "IMPORTANT: The response must end with either \"Conclusion: STOP\" or \"Conclusion: CONTINUE\".")


def solution_messages(question: str, memory: str) -> list[dict]:
    """The reference's direct-output prompt (planner.py `generate_direct_output`)."""
    return _user(
        "Task: Generate a concise final answer to the query based on all provided context.\n\n"
        f"Query: {question}{ANSWER_SUFFIX}\nActions Taken:\n{memory}\n\n"
        "Output: **Answer:** A direct and concise final answer.")


# ----------------------------------------------------------------------------- parsers
def parse_command(text: str) -> Optional[str]:
    """The executor's code: its last complete ```python block, else None."""
    return code_format.last_python_block(text or "")


def parse_conclusion(text: str) -> str:
    """STOP or CONTINUE, as the reference reads the verifier: the last "Conclusion: X", else the
    last of the words stop / continue, else CONTINUE."""
    found = re.findall(r"conclusion\s*\**\s*:\s*\**\s*(stop|continue)", text or "", re.IGNORECASE)
    if not found:
        found = re.findall(r"\b(stop|continue)\b", text or "", re.IGNORECASE)
    return STOP if found and found[-1].upper() == STOP else CONTINUE


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def final_answer(text: str) -> Optional[str]:
    """The solution's answer: the last <answer> tag's content, else the last \\boxed{}, else the
    whole reply (None when it is empty)."""
    tags = _ANSWER_TAG.findall(text or "")
    if tags:
        return tags[-1].strip()
    boxed = code_format.last_boxed(text or "")
    if boxed is not None:
        return boxed
    return (text or "").strip() or None


# ----------------------------------------------------------------------------- frozen modules
@dataclasses.dataclass(frozen=True)
class FrozenReply:
    text: str
    error: Optional[str] = None  # why the call failed (the text is then "")


class FrozenModel:
    """The frozen modules' model (executor, verifier, solution generator, the generator tool): any
    judges-style chat backend (`chat(messages, n, temperature, max_tokens) -> [text]`), called
    concurrently; the local backend batches concurrent calls into shared generate calls. Two
    kinds: `base_frozen_model` (the initial policy, never updated) and `http_frozen_model` (any
    OpenAI-compatible endpoint)."""

    def __init__(self, backend, *, temperature: float = 0.0, max_tokens: int = 256, workers: int = 16):
        self.backend, self.temperature, self.max_tokens = backend, float(temperature), int(max_tokens)
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="frozen")

    def complete(self, conversations: Sequence[list[dict]],
                 seeds: Optional[Sequence[int]] = None) -> list[FrozenReply]:
        """One reply per conversation, in order; a failed call is a reply with its error, never a
        raise. `seeds`: one per conversation, so that a sampled reply (temperature > 0) does not
        depend on the order the concurrent calls reach the backend, nor on a restart."""
        seeds = [None] * len(conversations) if seeds is None else list(seeds)
        if len(seeds) != len(conversations):
            raise ValueError(f"{len(seeds)} seeds for {len(conversations)} conversations")

        def one(messages, seed):
            try:
                return FrozenReply(self.backend.chat(messages, 1, self.temperature, self.max_tokens, seed)[0])
            except Exception as error:  # a backend down or a prompt too long: the rollout goes on
                return FrozenReply("", f"{type(error).__name__}: {error}")
        return list(self._pool.map(one, conversations, seeds))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def base_frozen_model(model, tokenizer, *, max_context: int, temperature: float = 0.0, max_tokens: int = 256,
                      seed: int = 0) -> FrozenModel:
    """The base model frozen: `model` (the initial policy; training never writes to it) sampled
    through a chat engine of its own."""
    from steprl_jax.judges.local_backend import LocalChatBackend

    backend = LocalChatBackend(model, tokenizer, max_context=max_context, seed=seed, name="frozen-base")
    return FrozenModel(backend, temperature=temperature, max_tokens=max_tokens)


def http_frozen_model(base_url: str, model: str, *, api_key_env: Optional[str] = None, timeout_s: float = 60.0,
                      temperature: float = 0.0, max_tokens: int = 256) -> FrozenModel:
    """An OpenAI-compatible endpoint (the judges' HTTP client, with its retries)."""
    from steprl_jax.judges.http_backend import HttpChatBackend

    backend = HttpChatBackend(base_url, model, api_key_env=api_key_env or None, timeout_s=timeout_s)
    return FrozenModel(backend, temperature=temperature, max_tokens=max_tokens)


# ----------------------------------------------------------------------------- the system
class FlowEnv:
    """What a flow rollout runs against (the suite's environment for `env.format` "flow"): the
    tools (`Python_Coder_Tool` runs code with the registry's `python` tool) and the frozen model.
    `result_chars`: how much of a command and of a result the memory shows."""

    format = "flow"
    schedule = "flow"  # the rollout schedule that runs this environment (evaluation reads it)

    def __init__(self, registry, frozen: FrozenModel, *, tool_names: Sequence[str] = (PYTHON_CODER, GENERATOR),
                 result_chars: int = 400, python_tool: str = "python"):
        unknown = [t for t in tool_names if t not in TOOLS]
        if unknown or not tool_names:
            raise ValueError(f"flow tools must be some of {tuple(TOOLS)}, got {tuple(tool_names)}")
        if PYTHON_CODER in tool_names and python_tool not in registry.names:
            raise ValueError(f"{PYTHON_CODER} runs the {python_tool!r} tool; the registry has {registry.names}")
        self.registry, self.frozen = registry, frozen
        self.tool_names, self.result_chars, self.python_tool = tuple(tool_names), int(result_chars), python_tool

    def messages(self, task) -> list[dict]:
        """The planner's first prompt (empty memory); the schedule renders every later one."""
        return planner_messages(task.question, self.tool_names, render_memory((), self.result_chars))

    def tool_schemas(self, task) -> None:
        return None  # the tools are described in the planner's prompt

    def release(self, task) -> None:
        pass

    def close(self) -> None:
        self.frozen.close()
