"""apply_chat: the checkpoint's own template, tools where the template takes them, generic rendering otherwise."""
import copy
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from steprl_jax.models import apply_chat
from steprl_jax.models.chat import render_tools
from models_real import smollm2_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MESSAGES = [{"role": "user", "content": "What is 17 * 23?"}]


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_tokenizer()


def test_own_template(smollm2):
    ids = apply_chat(smollm2, MESSAGES)
    assert ids == smollm2.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert apply_chat(smollm2, MESSAGES, tokenize=False).endswith("<|im_start|>assistant\n")
    assert not apply_chat(smollm2, MESSAGES, add_generation_prompt=False, tokenize=False).endswith("assistant\n")


def test_tools_where_template_ignores_them(smollm2):
    text = apply_chat(smollm2, MESSAGES, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\n" + render_tools(TOOLS) + "<|im_end|>\n<|im_start|>user\n")
    assert json.dumps(TOOLS[0], sort_keys=True) in text
    with_system = [{"role": "system", "content": "Be brief."}] + MESSAGES
    text = apply_chat(smollm2, with_system, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + render_tools(TOOLS))


def test_tools_where_template_takes_them(smollm2):
    tok = copy.deepcopy(smollm2)
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text = apply_chat(tok, MESSAGES, tools=TOOLS, tokenize=False)
    assert text == ("<|im_start|>system\ncalculator;<|im_end|>\n<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_generic_chatml_without_template(smollm2):
    tok = copy.deepcopy(smollm2)
    tok.chat_template = None
    messages = MESSAGES + [{"role": "assistant", "content": "<tool_call>x</tool_call>"},
                           {"role": "tool", "content": "391"}]
    text = apply_chat(tok, messages, tokenize=False)
    assert text == ("<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n<tool_call>x</tool_call>"
                    "<|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert apply_chat(tok, messages) == tok(text, add_special_tokens=False)["input_ids"]


def test_generic_gemma_turns_without_template():
    """A Gemma-style vocabulary without a template (as Gemma 3 270M base): BOS, turns, system folded in."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                                         "user", "model", "hi", "Be", "brief."])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers.processors import TemplateProcessing
    backend.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    assert tok.chat_template is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = apply_chat(tok, messages, tools=TOOLS, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\n" + render_tools(TOOLS) + "\n\nhi<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = apply_chat(tok, messages[1:])
    assert ids[:2] == [2, 4] and ids.count(2) == 1  # exactly one BOS
