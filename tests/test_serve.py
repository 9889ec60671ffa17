"""The OpenAI-compatible server, for real on 127.0.0.1, over a tiny random model and a byte-level tokenizer;
the HTTP judge and the local judge pointed at it."""
import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest
from flax import nnx

from steprl_jax.judges.http_backend import HttpChatBackend
from steprl_jax.judges.local_backend import LocalChatBackend
from steprl_jax.judges.model_judges import ProcessJudge, TrajectoryVerdictJudge
from steprl_jax.judges.items import StepItem, TrajectoryItem
from steprl_jax.models import ModelConfig, Transformer
from steprl_jax.serve import ChatEngine, ChatServer, parse_tool_calls, render_prompt

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_tokenizer():
    """A byte-level BPE without merges (256 byte tokens) plus ChatML's two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def tiny():
    tokenizer = byte_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = ModelConfig.tiny("llama", vocab_size=320, max_position_embeddings=4096, eos_token_ids=(eos,),
                              pad_token_id=eos)
    return Transformer(config, rngs=nnx.Rngs(0)), tokenizer


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    # Padding every batch to 8 rows keeps the number of compiled programs (and the test time) small.
    running = ChatServer(ChatEngine(model, tokenizer, max_context=2048, min_batch_rows=8), "tiny", port=0,
                         api_key=None).start()
    yield running
    running.close()


def call(url, body=None, method=None, headers=None):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


USER = [{"role": "user", "content": "Say something."}]


def test_models_and_chat_completions(server):
    status, models = call(server.url + "/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    status, reply = call(server.url + "/chat/completions",
                         {"model": "tiny", "messages": USER, "n": 3, "temperature": 1.0, "max_tokens": 5})
    assert status == 200 and reply["object"] == "chat.completion" and reply["model"] == "tiny"
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    for choice in reply["choices"]:
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
    usage = reply["usage"]
    assert usage["prompt_tokens"] > 10 and 1 <= usage["completion_tokens"] <= 15
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_greedy_and_seeded_sampling_are_reproducible_whatever_the_batch(server):
    body = {"messages": USER, "max_tokens": 6, "temperature": 0}
    first = call(server.url + "/chat/completions", body)[1]["choices"][0]["message"]["content"]
    assert call(server.url + "/chat/completions", body)[1]["choices"][0]["message"]["content"] == first
    seeded = {"messages": USER, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    alone = call(server.url + "/chat/completions", seeded)[1]["choices"][0]["message"]["content"]
    # The same request among concurrent others (batched together or not) gives the same text.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(call, server.url + "/chat/completions",
                              {"messages": [{"role": "user", "content": "x" * (i + 1)}], "max_tokens": 6,
                               "temperature": 1.0}) for i in range(5)]
        again = pool.submit(call, server.url + "/chat/completions", seeded)
        assert all(f.result()[0] == 200 for f in others)
    assert again.result()[1]["choices"][0]["message"]["content"] == alone


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "gpt-x", "messages": USER}, 404, "not served here"),
    ({"messages": USER, "stream": True}, 400, "streaming"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"messages": USER, "n": 1000}, 400, "n must be"),
    ({"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": USER, "temperature": -1}, 400, "temperature"),
    ({"messages": USER, "stop": 5}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "context limit"),
    (b"{not json", 400, "not valid JSON"),
])
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    got, reply = call(server.url + "/chat/completions", body)
    assert got == status and fragment in reply["error"]["message"]


def test_unknown_route_and_api_key(tiny):
    model, tokenizer = tiny
    guarded = ChatServer(ChatEngine(model, tokenizer, max_context=512), "tiny", port=0, api_key="k-123").start()
    try:
        assert call(guarded.url + "/models")[0] == 401
        assert call(guarded.url + "/models", headers={"Authorization": "Bearer k-123"})[0] == 200
        assert call(guarded.url + "/nothing", headers={"Authorization": "Bearer k-123"})[0] == 404
    finally:
        guarded.close()


def test_stop_strings_are_not_returned(server):
    # Greedy text of the random model, then stop at a piece of it.
    text = call(server.url + "/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0})[1]
    text = text["choices"][0]["message"]["content"]
    if len(text) < 4:
        pytest.skip("the random model ended its turn at once")
    stop = text[2:4]
    reply = call(server.url + "/chat/completions",
                 {"messages": USER, "max_tokens": 8, "temperature": 0, "stop": [stop]})[1]["choices"][0]
    assert reply["finish_reason"] == "stop" and reply["message"]["content"] == text[:text.index(stop)]


def test_tools_in_prompt_and_tool_calls_out(tiny):
    _, tokenizer = tiny
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "<think>look</think>",
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = render_prompt(tokenizer, history, tools)
    assert '"name": "weather"' in prompt and "<tools>" in prompt  # described for a template without tools
    assert '<tool_call>[{"name": "weather", "arguments": {"city": "Paris"}}]</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>tool\nsunny" in prompt

    content, calls = parse_tool_calls('<think>t</think><tool_call>[{"name": "a", "arguments": {"x": 1}}, '
                                      '{"name": "b"}]</tool_call>')
    assert content == "<think>t</think>" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1} and calls[0]["type"] == "function"
    assert parse_tool_calls("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"name": "q", "arguments": {}}</tool_call>')[1][0]["function"]["name"] == "q"


def test_http_judge_against_the_real_server_counts_unreadable_replies(server):
    # The random model writes no verdict: every reply is counted as unparsed, no label is guessed.
    judge = ProcessJudge(HttpChatBackend(server.url, "tiny", timeout_s=60), votes=3, max_tokens=4)
    verdicts = judge.judge_steps([StepItem("q?", "", "<answer>1</answer>"), StepItem("r?", "", "<answer>2</answer>")])
    assert all(v.label is None and v.failure_code == "unparsed" and v.unparsed == 3 and len(v.raw) == 3
               for v in verdicts)
    assert judge.stats.snapshot()["unparsed_replies"] == 6


def test_local_judge_backend_batches_concurrent_items(server, tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="needs"):
        LocalChatBackend(model)
    backend = LocalChatBackend(engine=server.engine)  # shares the server's compiled programs
    judge = TrajectoryVerdictJudge(backend, votes=2, max_tokens=3, max_workers=4)
    verdicts = judge.judge([TrajectoryItem(f"q{i}", "", reference="r") for i in range(4)])
    assert len(verdicts) == 4 and all(len(v.raw) == 2 for v in verdicts)
    assert judge.stats.snapshot()["verdicts"] == 4
