"""The three judge prompts, as chat messages.

What each judge may see is the point of the method (METHODS.md 1.3, 2.2):
* process (SWiRL): the question, the earlier actions and observations, and the last action.
  Never the golden answer; the function has no parameter through which it could pass.
* outcome: the question, the predicted final answer and the answer key.
* trajectory (PORTool): the whole trajectory, tool outputs and errors included, and the
  reference answer when one exists.

A history or trajectory is either text or a list of chat messages (role/content, with optional
OpenAI-style `tool_calls`); messages are rendered as a plain transcript for the judge.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

History = str | Sequence[Mapping[str, Any]]

PROCESS_SYSTEM = (
    "You are a careful reviewer of an AI agent that solves tasks step by step with tools. "
    "You judge whether one step was reasonable, not whether the task ends up solved.")
# What the process judge and the reward model both see before the step (never a golden answer).
_STEP_CONTEXT = """The agent is working on this question:
<question>
{question}
</question>

Everything the agent has done so far (its earlier actions and what the tools returned):
<history>
{history}
</history>

"""
PROCESS_TEMPLATE = _STEP_CONTEXT + """The agent's latest action:
<action>
{action}
</action>

Is the latest action a reasonable next step given the question and the history? A reasonable step makes \
progress or gathers information that is plausibly needed, uses tools sensibly, and does not contradict \
what the tools already returned. Do not try to solve the question yourself; judge only the step.
Think briefly, then end with a final line of exactly "Verdict: GOOD" or "Verdict: BAD"."""

OUTCOME_SYSTEM = "You are a strict grader who compares a predicted answer with an answer key."
OUTCOME_TEMPLATE = """Question:
<question>
{question}
</question>

Predicted answer:
<predicted>
{predicted}
</predicted>

Answer key:
<answer_key>
{answer_key}
</answer_key>

Does the predicted answer give the same answer as the answer key? Ignore differences of wording, \
formatting, units written differently and harmless extra detail; an answer that is vague, hedges between \
options, or contradicts the key is wrong.
End with a final line of exactly "Verdict: YES" or "Verdict: NO"."""

TRAJECTORY_SYSTEM = (
    "You evaluate the final answer of an AI assistant that used tools, using the whole trajectory "
    "as evidence.")
TRAJECTORY_TEMPLATE = """User query:
<query>
{question}
</query>

The assistant's full trajectory (its steps, the tool calls, tool outputs and tool errors, and its final \
answer):
<trajectory>
{trajectory}
</trajectory>

{reference_block}Decide one of:
- true: the final answer correctly and sufficiently answers the query{true_basis}.
- false: the final answer is wrong, unsupported, or missing although the tools provided what was needed.
- unable_to_answer: the assistant followed a reasonable strategy but could not complete the task because \
of the tools (missing information, tool failures or errors it could not recover from).
Think briefly, then end with a final line of exactly "Verdict: true", "Verdict: false" or \
"Verdict: unable_to_answer"."""

OMITTED = "[... {n} earlier characters omitted ...]"


def render_history(history: History, max_chars: int | None = None) -> str:
    """A transcript of `history`; when longer than `max_chars`, its beginning is cut (the end matters most)."""
    text = history if isinstance(history, str) else "\n\n".join(_render_message(m) for m in history)
    text = text.strip() or "(nothing yet: this is the first action)"
    if max_chars is not None and len(text) > max_chars:
        cut = len(text) - max_chars
        text = OMITTED.format(n=cut) + "\n" + text[cut:]
    return text


def _render_message(message: Mapping[str, Any]) -> str:
    role = str(message.get("role", "unknown"))
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    parts = [str(content)] if content else []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        parts.append(f"[tool call] {function.get('name')}({_arguments(function.get('arguments'))})")
    label = role if not message.get("name") else f"{role} {message['name']}"
    return f"[{label}]\n" + "\n".join(parts)


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _answer_text(value: Any) -> str:
    """A reference or answer key; a list of acceptable answers is shown as alternatives."""
    if isinstance(value, (list, tuple)):
        return " | ".join(str(v).strip() for v in value)
    return str(value).strip()


def _clip(text: str, max_chars: int | None) -> str:
    text = str(text).strip()
    if max_chars is not None and len(text) > max_chars:
        return text[:max_chars] + f" [... {len(text) - max_chars} characters omitted ...]"
    return text


def process_messages(question: str, history: History, action: str,
                     max_history_chars: int | None = None) -> list[dict]:
    """The SWiRL process prompt: question, earlier steps, last action. No golden answer."""
    user = PROCESS_TEMPLATE.format(question=str(question).strip(),
                                   history=render_history(history, max_history_chars),
                                   action=str(action).strip() or "(empty)")
    return [{"role": "system", "content": PROCESS_SYSTEM}, {"role": "user", "content": user}]


def outcome_messages(question: str, predicted: str | None, answer_key: Any,
                     max_answer_chars: int | None = 4000) -> list[dict]:
    """The outcome prompt: question, predicted answer, answer key (YES/NO)."""
    predicted_text = "(no answer given)" if predicted is None or not str(predicted).strip() else predicted
    user = OUTCOME_TEMPLATE.format(question=str(question).strip(), predicted=_clip(predicted_text, max_answer_chars),
                                   answer_key=_answer_text(answer_key))
    return [{"role": "system", "content": OUTCOME_SYSTEM}, {"role": "user", "content": user}]


def trajectory_messages(question: str, trajectory: History, reference: Any = None,
                        max_trajectory_chars: int | None = None) -> list[dict]:
    """PORTool's verdict prompt: the whole trajectory, and the reference answer when one exists."""
    if reference is not None and _answer_text(reference):
        reference_block = f"Reference answer:\n<reference>\n{_answer_text(reference)}\n</reference>\n\n"
        true_basis = " (it agrees with the reference answer)"
    else:
        reference_block = "There is no fixed reference answer: judge from the evidence in the trajectory.\n\n"
        true_basis = " and is supported by the evidence in the trajectory"
    user = TRAJECTORY_TEMPLATE.format(question=str(question).strip(),
                                      trajectory=render_history(trajectory, max_trajectory_chars),
                                      reference_block=reference_block, true_basis=true_basis)
    return [{"role": "system", "content": TRAJECTORY_SYSTEM}, {"role": "user", "content": user}]


# ------------------------------------------------------------------ SWiRL's reward model R(a | s)
# The stage-2 reward prompt (METHODS.md 1.4): the question, the state and a freshly sampled action;
# never a golden answer (no parameter could carry one). Binary asks for GOOD/BAD, graded for 0-10.
REWARD_SYSTEM = (
    "You are a careful reviewer of an AI agent that solves tasks step by step with tools. "
    "You rate one proposed next step given what came before, not whether the task ends up solved.")
REWARD_TEMPLATE = _STEP_CONTEXT + """The agent's proposed next action:
<action>
{action}
</action>

A good next step makes progress or gathers information that is plausibly needed, uses exactly one tool \
sensibly or gives a final answer the history supports, repeats nothing already done, and does not \
contradict what the tools already returned. Do not try to solve the question yourself; judge only the step.
{instruction}"""
REWARD_INSTRUCTIONS = {
    "binary": 'Think briefly, then end with a final line of exactly "Verdict: GOOD" or "Verdict: BAD".',
    "graded": ("Think briefly, then rate the step from 0 (useless or wrong) to 10 (clearly the right next step) "
               'and end with a final line of exactly "Score: N", where N is a whole number from 0 to 10.'),
}


# Chat-template markup that closes the user's turn and opens the assistant's (ChatML, Llama 3, Gemma).
_TURN_MARKUP = re.compile(r"(?:\s*(?:<\|[^|<>\n]{1,40}\|>|</?(?:start|end)_of_turn>)\s*(?:assistant|model)?)*\s*")


def state_since_question(question: str, state: History) -> History:
    """The agent's part of a state: what follows the question.

    A SWiRL state text is the whole prompt (system prompt, worked examples, the question) followed by the
    agent's actions and observations; the text after the last occurrence of the question is returned,
    without the chat-template markup that ends the user's turn (e.g. `<|im_end|>\n<|im_start|>assistant`),
    or the whole text when the question does not occur in it. For chat messages: those after the last
    user message (all of them when there is none).
    """
    if isinstance(state, str):
        key = str(question).strip()
        at = state.rfind(key) if key else -1
        if at < 0:
            return state
        rest = state[at + len(key):]
        return rest[_TURN_MARKUP.match(rest).end():]
    messages = list(state)
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    return messages[users[-1] + 1:] if users else messages


def reward_messages(question: str, state: History, action: str, scale: str = "binary",
                    max_state_chars: int | None = None) -> list[dict]:
    """The reward prompt: question, the agent's part of the state (`state_since_question`), the sampled
    action, and the GOOD/BAD ("binary") or 0-10 ("graded") instruction. No golden answer."""
    if scale not in REWARD_INSTRUCTIONS:
        raise ValueError(f"reward scale must be one of {sorted(REWARD_INSTRUCTIONS)}, got {scale!r}")
    user = REWARD_TEMPLATE.format(question=str(question).strip(),
                                  history=render_history(state_since_question(question, state), max_state_chars),
                                  action=str(action).strip() or "(empty)", instruction=REWARD_INSTRUCTIONS[scale])
    return [{"role": "system", "content": REWARD_SYSTEM}, {"role": "user", "content": user}]
