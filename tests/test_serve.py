"""The OpenAI-compatible server, for real on 127.0.0.1, over a tiny random model and a byte-level tokenizer;
the HTTP judge and the local judge pointed at it; OpenAI's own Python client against it (streaming,
errors, limits); the load generator."""
import concurrent.futures
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from steprl_jax.benchmarks import serve_load
from steprl_jax.judges.http_backend import HttpChatBackend
from steprl_jax.judges.local_backend import LocalChatBackend
from steprl_jax.judges.model_judges import ProcessJudge, TrajectoryVerdictJudge
from steprl_jax.judges.items import StepItem, TrajectoryItem
from steprl_jax.sampling.chat_engine import ChatEngine, Completion, Delta, IncrementalText
from steprl_jax.sampling.chat_format import parse_tool_calls, render_prompt
from steprl_jax.serve import ChatServer, ServerLimits
from steprl_jax.serve.app import ChatRequest, completion_response, stream_chunks



try:
    import openai  # the `test` extra
except ImportError:
    openai = None
needs_openai = pytest.mark.skipif(openai is None, reason="needs the openai package (pip install openai)")


def openai_client(server, api_key="unused", timeout=120):
    return openai.OpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def tiny():
    return serve_load.tiny_model()  # a tiny random Llama with the byte-level ChatML tokenizer


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
    ({"messages": USER, "stream": "yes"}, 400, "stream must be"),
    ({"messages": USER, "max_tokens": 5000}, 400, "max_tokens is 5000; this server allows at most 4096"),
    ({"messages": USER, "max_completion_tokens": 4097}, 400, "max_completion_tokens is 4097"),
    ({"messages": USER, "seed": 2 ** 70}, 400, "seed"),
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


def test_unknown_route_and_api_key(server):
    guarded = ChatServer(server.engine, "tiny", port=0, api_key="k-123").start()
    try:
        assert call(guarded.url + "/models")[0] == 401
        assert call(guarded.url + "/models", headers={"Authorization": "Bearer k-123"})[0] == 200
        assert call(guarded.url + "/nothing", headers={"Authorization": "Bearer k-123"})[0] == 404
        if openai is None:
            return
        # OpenAI's client: a wrong key is its AuthenticationError; the right one works.
        with pytest.raises(openai.AuthenticationError) as info:
            openai_client(guarded, api_key="k-124").models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        reply = openai_client(guarded, api_key="k-123").chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, temperature=0)
        assert reply.choices[0].message.role == "assistant"
    finally:
        guarded.close(close_engine=False)


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


# ----------------------------------------------------------------------------- streaming, OpenAI's client
def reassemble(stream):
    """{index: text}, {index: finish_reason}, usage, content chunks, roles of a chunk stream."""
    texts, finish, usage, pieces, roles = {}, {}, None, 0, []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces += 1
                texts[choice.index] = texts.get(choice.index, "") + choice.delta.content
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage, pieces, roles


@needs_openai
def test_openai_client_streams_exactly_the_plain_reply(server):
    client = openai_client(server)
    assert [m.id for m in client.models.list()] == ["tiny"]
    # Sampled text of the random model is random bytes: multi-byte characters split over tokens and chunks.
    body = dict(model="tiny", messages=USER, max_tokens=40, temperature=1.0, seed=11)
    plain = client.chat.completions.create(**body)
    texts, finish, usage, pieces, roles = reassemble(client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}))
    assert texts.get(0, "") == plain.choices[0].message.content and roles == ["assistant"]
    assert finish == {0: plain.choices[0].finish_reason}
    assert usage.completion_tokens == plain.usage.completion_tokens and usage.prompt_tokens == plain.usage.prompt_tokens
    if plain.usage.completion_tokens > 2 * server.engine.decode_chunk:
        assert pieces >= 2  # sent as it was decoded, not at the end
    # The client's streaming helper accumulates the final completion itself (and wants it to end with a stop).
    stop = stop_inside(plain.choices[0].message.content)
    want = client.chat.completions.create(**body, stop=stop).choices[0]
    with client.chat.completions.stream(**body, stop=stop) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == want.message.content and want.finish_reason == "stop"


def stop_inside(text: str) -> str:
    """Two characters from the middle of `text` that the model wrote (not a replacement for broken bytes)."""
    for i in range(3, len(text) - 1):
        if "\ufffd" not in text[i:i + 2]:
            return text[i:i + 2]
    pytest.skip("the random model wrote too little text")


@needs_openai
def test_openai_client_streams_n_choices_and_stop_strings(server):
    client = openai_client(server)
    body = dict(model="tiny", messages=USER, max_tokens=20, temperature=1.0, seed=5, n=2)
    plain = client.chat.completions.create(**body)
    texts, finish, _, _, roles = reassemble(client.chat.completions.create(**body, stream=True))
    assert roles == ["assistant", "assistant"]
    assert [texts.get(i, "") for i in (0, 1)] == [c.message.content for c in plain.choices]
    assert finish == {c.index: c.finish_reason for c in plain.choices}
    # A stop string from the middle of the text: the stream never sends what the stop cuts.
    text = plain.choices[0].message.content
    stop = stop_inside(text)
    body = dict(model="tiny", messages=USER, max_tokens=20, temperature=1.0, seed=5, stop=[stop])
    plain = client.chat.completions.create(**body).choices[0]
    texts, finish, _, _, _ = reassemble(client.chat.completions.create(**body, stream=True))
    assert plain.message.content == text[:text.index(stop)] and plain.finish_reason == "stop"
    assert texts.get(0, "") == plain.message.content and finish == {0: "stop"}


@needs_openai
def test_openai_client_error_classes(server):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=5000)
    assert info.value.status_code == 400 and info.value.param == "max_tokens" and "max_tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, n=17, stream=True)
    assert info.value.param == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-x", messages=USER)


def test_incremental_text_holds_back_partial_characters_and_stop_prefixes():
    table = [bytes([i]) for i in range(256)]
    text = IncrementalText(table, stop=("END",))
    ids = list("aé€E".encode())  # é: 2 bytes, €: 3 bytes
    assert text.update(ids[:2]) == "a"  # half of é
    assert text.update(ids[:4]) == "é"  # é, then the first byte of €
    assert text.update(ids[:6]) == "€"
    assert text.update(ids[:7]) == ""  # "E" may start "END"
    assert text.update(ids[:7] + list(b"x")) == "Ex"
    assert text.update(ids[:7] + list(b"xEN")) == ""  # "EN" too
    assert text.finish("aé€Ex") == "" and text.sent == "aé€Ex"  # "END" came: the final text stops before it
    # Invalid bytes are replaced once they are known to be invalid, as the final decode does.
    text = IncrementalText(table, stop=())
    assert text.update([0xE2, 0x82]) == "" and text.update([0xE2, 0x82, 0x41]) == "\ufffdA"


@needs_openai
def test_streamed_tool_calls_add_up_to_the_plain_reply():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    request = ChatRequest(messages=USER, n=2, temperature=0, top_p=1, max_tokens=64, stop=(), tools=tools, seed=None,
                          stream=True, include_usage=True)
    texts = ['  Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>\n',
             "No tool is needed. <tool"]
    completions = [Completion(t, "stop", 7, 9) for t in texts]
    # The text arrives in pieces, as after decode chunks; the last piece carries the completion.
    deltas = []
    for i, (text, completion) in enumerate(zip(texts, completions)):
        pieces = [text[j:j + 5] for j in range(0, len(text), 5)]
        deltas += [Delta(i, p) for p in pieces[:-1]] + [Delta(i, pieces[-1], completion)]
    assert ["".join(d.text for d in deltas if d.index == i) for i in (0, 1)] == texts
    chunks = list(stream_chunks("tiny", request, 7, deltas))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18
    sent = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"][0]["index"] == 0)
    assert "<tool" not in sent and not sent.startswith(" ")  # never content that becomes a tool call
    state = ChatCompletionStreamState(input_tools=tools)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion()
    plain = completion_response("tiny", request, completions)
    for got, want in zip(streamed.choices, plain["choices"]):
        assert got.finish_reason == want["finish_reason"] and got.message.content == want["message"]["content"]
        calls = want["message"].get("tool_calls") or []
        assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    first = plain["choices"][0]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Let me look."
    assert plain["choices"][1]["message"]["content"] == "No tool is needed. <tool"


# ----------------------------------------------------------------------------- limits
@pytest.fixture(scope="module")
def limited(server):
    """A second server on the same engine, with tight limits."""
    limits = ServerLimits(max_concurrent_requests=2, request_timeout_s=1.0, client_timeout_s=0.5, max_body_bytes=4096)
    running = ChatServer(server.engine, "tiny", port=0, limits=limits).start()
    yield running
    running.close(close_engine=False)


def wait_for(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


@needs_openai
def test_concurrency_limit_answers_429_and_timeouts_504_and_free_their_slots(server, limited):
    client = openai_client(limited, timeout=30)
    in_flight = lambda: call(limited.url.removesuffix("/v1") + "/health")[1]["in_flight"]  # noqa: E731
    body = dict(model="tiny", messages=USER, max_tokens=4, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # While the engine's lock is held no request reaches it: two stay in flight, past their timeout.
        with server.engine._cv:
            plain = pool.submit(client.chat.completions.create, **body)
            streamed = pool.submit(lambda: reassemble(client.chat.completions.create(**body, stream=True)))
            wait_for(lambda: in_flight() == 2)
            with pytest.raises(openai.RateLimitError) as info:
                client.chat.completions.create(**body)
            assert not plain.done() and not streamed.done()  # refused at once, while the others still wait
            assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
            assert info.value.response.headers["retry-after"] == "1"
            time.sleep(1.1)
        with pytest.raises(openai.InternalServerError) as info:
            plain.result()
        assert info.value.status_code == 504 and info.value.code == "timeout"
        with pytest.raises(openai.APIError, match="did not finish within 1.0 s"):
            streamed.result()  # after the headers: an error event, which the client raises
    wait_for(lambda: in_flight() == 0)
    assert server.engine.complete(USER, max_tokens=2, temperature=0, timeout=60)[0].completion_tokens == 2


def test_cancelled_generation_stops_at_its_next_decode_chunk(server):
    engine = server.engine
    job = engine.submit(USER, max_tokens=1500, temperature=0, stream=True)  # greedy: ~1500 tokens, no end of turn
    first = job.next_delta(timeout=120)
    assert first is not None and first.completion is None
    job.cancel()
    assert engine.complete(USER, max_tokens=2, temperature=0, timeout=120)[0].completion_tokens == 2
    # Had its rows run on, the worker would have finished them (and sent the completion) first.
    while (delta := job.next_delta(timeout=0)) is not None:
        assert delta.completion is None


def test_generation_past_its_deadline_answers_504_and_frees_its_slot(server, limited):
    engine = server.engine
    # Compile the decode program first (a streamed request of the same size, dropped after its first chunk),
    # so that the deadline passes while the rows decode, not while they compile.
    warm = engine.submit(USER, max_tokens=1500, temperature=0, stream=True)
    assert warm.next_delta(timeout=300) is not None
    warm.cancel()
    assert engine.complete(USER, max_tokens=2, temperature=0, timeout=120)[0].completion_tokens == 2
    in_flight = lambda: call(limited.url.removesuffix("/v1") + "/health")[1]["in_flight"]  # noqa: E731
    # Greedy: ~1500 tokens without an end of turn, far more than the limited server's 1 s allows.
    # 504 (not 200) is the proof that the deadline cut the generation short; no wall-clock bound
    status, reply = call(limited.url + "/chat/completions",
                         {"model": "tiny", "messages": USER, "max_tokens": 1500, "temperature": 0})
    assert status == 504
    assert reply == {"error": {"message": "the request did not finish within 1.0 s", "type": "server_error",
                               "param": None, "code": "timeout"}}
    wait_for(lambda: in_flight() == 0)
    # The slot is free and the worker is not busy with the dropped rows: a small request is answered.
    status, reply = call(limited.url + "/chat/completions",
                         {"model": "tiny", "messages": USER, "max_tokens": 3, "temperature": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3


def test_slow_and_oversized_requests(limited):
    host, port = limited.httpd.server_address[:2]
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"mess")
    # A body that stops halfway: 408 once the client timeout (0.5 s) has passed, and the connection closes.
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(head)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    # A body that trickles in (a byte every 0.1 s: 9 s for all of it) is cut off too: the server
    # closes before the body is complete, counted in bytes sent, not in seconds.
    missing = 100 - len(head.split(b"\r\n\r\n", 1)[1])
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(head)
        sock.settimeout(0.1)
        sent, reply = 0, b""
        while sent < 2 * missing:  # past the body's end only if the server never cut us off
            try:
                chunk = sock.recv(4096)
            except socket.timeout:
                try:
                    sock.sendall(b" ")
                    sent += 1
                except OSError:
                    break
                continue
            except OSError:  # reset: the server closed with our trickled bytes unread
                break
            if not chunk:
                break
            reply += chunk
        assert sent < missing, f"the server read the whole trickled body ({sent} of {missing} bytes)"
        assert reply == b"" or reply.startswith(b"HTTP/1.1 408")
    # An idle connection is closed after the client timeout.
    with socket.create_connection((host, port), timeout=10) as sock:
        assert sock.recv(4096) == b""
    status, reply = call(limited.url + "/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]})
    assert status == 413 and "at most 4096" in reply["error"]["message"]


def test_streaming_to_an_http10_client_ends_with_the_connection(server):
    host, port = server.httpd.server_address[:2]
    body = json.dumps({"messages": USER, "max_tokens": 4, "temperature": 0, "stream": True}).encode()
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, events = reply.partition(b"\r\n\r\n")
    assert b"200 OK" in head and b"Transfer-Encoding" not in head and b"Connection: close" in head
    events = [e for e in events.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"]


def test_load_generator_runs_against_the_server(server):
    from steprl_jax.benchmarks.serve_load import format_summary, run_load

    summary = run_load(server.url, "tiny", clients=3, requests_per_client=2, max_tokens=6, duration_s=120)
    assert summary["ok"] == summary["sent"] == 6 and summary["errors"] == 0 and summary["mismatches"] == 0
    assert summary["streamed"] == 3 and summary["duplicate_ids"] == 0 and summary["responses_429"] == 0
    assert summary["latency_s"]["p50"] > 0 and summary["tokens_per_s"] > 0
    assert "mismatches 0" in format_summary("tiny", summary)
