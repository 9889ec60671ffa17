"""The HTTP judge backend against real local HTTP servers on 127.0.0.1: replies, retries, faults, cache."""
import http.server
import json
import logging
import threading
import time

import pytest

from steprl_jax.judges.backends import BackendError, CachedBackend
from steprl_jax.judges.cache import ReplyCache
from steprl_jax.judges.http_backend import HttpChatBackend
from steprl_jax.judges.model_judges import OutcomeItem, OutcomeJudge, ProcessJudge, StepItem

SECRET = "sk-test-do-not-log-0123456789"


class StubServer:
    """An OpenAI chat-completions server whose next replies follow a script of faults.

    `faults` is consumed one entry per request: "500", "429", "400", "sleep", "garbage", "reset", "few";
    when it is empty the server answers normally with `reply(body, i)` for each of the n choices.
    """

    def __init__(self, reply=lambda body, i: "Verdict: GOOD", sleep_s=2.0):
        self.reply = reply
        self.sleep_s = sleep_s
        self.faults: list[str] = []
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.sleeping = 0
        self.wake = None  # an Event: a "sleep" ends when it is set (sleep_s then only guards a hang)
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append(body)
                    stub.headers.append(dict(self.headers))
                    fault = stub.faults.pop(0) if stub.faults else None
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    self._answer(body, fault)
                finally:
                    with stub.lock:
                        stub.in_flight -= 1

            def _answer(self, body, fault):
                if fault in ("500", "429", "400"):
                    self._send(int(fault), b'{"error": {"message": "injected"}}',
                               {"Retry-After": "0"} if fault == "429" else {})
                    return
                if fault == "sleep":
                    stub.sleeping += 1
                    if stub.wake is None:
                        time.sleep(stub.sleep_s)
                    else:
                        stub.wake.wait(stub.sleep_s)
                    stub.sleeping -= 1
                if fault == "garbage":
                    self._send(200, b"<html>not json at all")
                    return
                if fault == "reset":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'{"choi')
                    return
                n = 1 if fault == "few" else body.get("n", 1)
                choices = [{"index": i, "message": {"role": "assistant", "content": stub.reply(body, i)},
                            "finish_reason": "stop"} for i in range(n)]
                self._send(200, json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                                            "choices": choices}).encode())

            def _send(self, code, payload, headers=None):
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    for key, value in (headers or {}).items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout): that is the point of the fault

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = StubServer()
    yield server
    server.close()


def backend_for(stub, **kwargs):
    settings = dict(model="judge-model", timeout_s=1.0, retries=2, backoff_s=0.01, max_backoff_s=0.05)
    settings.update(kwargs)
    return HttpChatBackend(stub.base_url, **settings)


def test_chat_returns_n_replies_and_sends_the_openai_body(stub):
    stub.reply = lambda body, i: f"reply {i}"
    replies = backend_for(stub).chat([{"role": "user", "content": "hi"}], n=3, temperature=0.5, max_tokens=7)
    assert replies == ["reply 0", "reply 1", "reply 2"]
    body = stub.requests[0]
    assert body["model"] == "judge-model" and body["n"] == 3 and body["max_tokens"] == 7
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["temperature"] == 0.5


def test_endpoint_that_returns_fewer_choices_is_asked_for_the_rest(stub):
    stub.faults = ["few"]
    replies = backend_for(stub).chat([{"role": "user", "content": "x"}], n=3, temperature=1.0, max_tokens=5)
    assert len(replies) == 3
    assert [r["n"] for r in stub.requests] == [3, 2]


def test_max_n_per_request_splits_votes(stub):
    backend_for(stub, max_n_per_request=1).chat([{"role": "user", "content": "x"}], 3, 1.0, 5)
    assert [r["n"] for r in stub.requests] == [1, 1, 1]


@pytest.mark.parametrize("faults", [["500", "500"], ["garbage"], ["sleep"], ["429", "reset"]])
def test_transient_faults_are_retried(stub, faults):
    stub.sleep_s = 2.0
    stub.faults = list(faults)
    backend = backend_for(stub, timeout_s=0.5)
    assert backend.chat([{"role": "user", "content": "x"}], 1, 0.0, 5) == ["Verdict: GOOD"]
    assert backend.stats["retries"] == len(faults)


def test_down_endpoint_fails_with_reason_after_retries_and_run_continues(stub):
    stub.faults = ["500"] * 10
    judge = ProcessJudge(backend_for(stub, retries=2), votes=1)
    verdicts = judge.judge_steps([StepItem("q", "", "<answer>1</answer>")])
    assert not verdicts[0].ok
    assert verdicts[0].failed_reason.startswith("backend: HTTP 500")
    assert "after 3 attempts" in verdicts[0].failed_reason
    assert len(stub.requests) == 3
    assert judge.stats.snapshot()["failed/backend"] == 1
    # The next call succeeds once the endpoint recovers.
    stub.faults = []
    assert judge.judge_steps([StepItem("q", "", "<answer>1</answer>")])[0].label == "GOOD"


def test_unreachable_endpoint_and_slow_endpoint_fail_with_reasons():
    backend = HttpChatBackend("http://127.0.0.1:9/v1", "m", timeout_s=0.5, retries=1, backoff_s=0.01)
    with pytest.raises(BackendError, match="connection failed"):
        backend.chat([{"role": "user", "content": "x"}], 1, 0.0, 5)
    server = StubServer(sleep_s=1.5)
    try:
        server.faults = ["sleep"] * 5
        with pytest.raises(BackendError, match="timed out after 0.3s"):
            backend_for(server, timeout_s=0.3, retries=1).chat([{"role": "user", "content": "x"}], 1, 0.0, 5)
    finally:
        server.close()


def test_client_errors_are_not_retried(stub):
    stub.faults = ["400"]
    with pytest.raises(BackendError, match="HTTP 400"):
        backend_for(stub).chat([{"role": "user", "content": "x"}], 1, 0.0, 5)
    assert len(stub.requests) == 1


def test_api_key_is_sent_but_never_logged_or_recorded(stub, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", SECRET)
    stub.faults = ["500", "500", "500"]
    stub.reply = lambda body, i: f"echo {SECRET}"  # even a server that echoes the key
    backend = backend_for(stub, api_key_env="JUDGE_KEY_FOR_TEST", retries=1)
    cached = CachedBackend(backend, ReplyCache(tmp_path))
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(BackendError) as failure:
            cached.chat([{"role": "user", "content": "x"}], 1, 0.0, 5)
    assert stub.headers[0]["Authorization"] == f"Bearer {SECRET}"
    assert SECRET not in str(failure.value) and SECRET not in repr(backend) and SECRET not in caplog.text
    assert SECRET not in json.dumps(cached.request([{"role": "user", "content": "x"}], 1, 0.0, 5))
    with pytest.raises(ValueError, match="JUDGE_KEY_MISSING"):
        HttpChatBackend("https://judge.example.org/v1", "m", api_key_env="JUDGE_KEY_MISSING")
    # A local endpoint is called without a key when the variable is unset.
    assert HttpChatBackend(stub.base_url, "m", api_key_env="JUDGE_KEY_MISSING")._api_key is None


def test_concurrency_limit_and_a_slow_call_does_not_block_the_batch(stub):
    # The first request is slow: it is answered only once the other 11 have been, so no clock
    # decides the test (sleep_s only ends a hang, which the assertions then report).
    stub.faults = ["sleep"]
    stub.sleep_s = 30.0
    stub.wake = threading.Event()
    finished_during_sleep = []
    fast_reply = stub.reply

    def reply(body, i):
        if stub.sleeping:
            finished_during_sleep.append(i)
            if len(finished_during_sleep) == 11:
                stub.wake.set()
        return fast_reply(body, i)

    stub.reply = reply
    judge = ProcessJudge(backend_for(stub, timeout_s=60.0, max_concurrency=3), max_workers=8)
    items = [StepItem(f"q{i}", "", "a") for i in range(12)]
    verdicts = judge.judge_steps(items)
    assert [v.label for v in verdicts] == ["GOOD"] * 12
    # Never more than the limit. (Whether fast requests overlap enough to reach it depends on
    # scheduling; the slow one plus at least one other is certain.)
    assert 2 <= stub.max_in_flight <= 3
    # All other requests were answered while the slow one was still in flight, not after it (the
    # Event, not a clock, released it; had the 30 s guard ended it, fewer would be counted here).
    assert len(finished_during_sleep) == 11


def test_cache_answers_a_rerun_without_the_endpoint(stub, tmp_path):
    stub.reply = lambda body, i: "Verdict: YES"
    items = [OutcomeItem("2+2?", "4", "4"), OutcomeItem("capital of France?", "Paris", "Paris")]
    first = OutcomeJudge(CachedBackend(backend_for(stub), ReplyCache(tmp_path)), votes=3).judge(items)
    assert len(stub.requests) == 2
    stub.faults = ["500"] * 100  # the endpoint is now down: a re-run must not need it
    second = OutcomeJudge(CachedBackend(backend_for(stub), ReplyCache(tmp_path)), votes=3).judge(items)
    assert len(stub.requests) == 2
    assert [v.label for v in first] == [v.label for v in second] == ["YES", "YES"]
    assert first[0].votes == {"YES": 3}
    # A different request (another vote count) is a miss.
    OutcomeJudge(CachedBackend(backend_for(stub, retries=0), ReplyCache(tmp_path)), votes=1).judge(items[:1])
    assert len(stub.requests) == 3


def test_failures_are_not_cached(stub, tmp_path):
    stub.faults = ["500"]
    cached = CachedBackend(backend_for(stub, retries=0), ReplyCache(tmp_path))
    with pytest.raises(BackendError):
        cached.chat([{"role": "user", "content": "x"}], 1, 0.0, 5)
    assert cached.chat([{"role": "user", "content": "x"}], 1, 0.0, 5) == ["Verdict: GOOD"]
