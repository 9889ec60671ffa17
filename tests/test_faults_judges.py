"""Judge faults under load: the outcome judge of a 64-episode batch against a real OpenAI-compatible
endpoint on 127.0.0.1 that fails 30% of its calls.

Each attempt's fate is drawn from (seed, episode, attempt number), so the faults do not depend on
thread timing: 500, 429 with Retry-After, a garbage body, a body trickled byte by byte past the
client's time limit, or a TCP reset. The judge is built the way every job builds it
(`Judging.from_config`, an http outcome judge behind the reply cache), and its verdicts are stored and
read back as records.
"""
import datetime
import http.server
import json
import logging
import random
import re
import socket
import struct
import threading
import time
from email.utils import formatdate

import pytest

from steprl_jax.agents.records import RecordStore, Step, Trajectory
from steprl_jax.judges.http_backend import HttpChatBackend
from steprl_jax.judges.judging import Judging

EPISODES = 64
FAULT_RATE = 0.30
KINDS = ("500", "429", "garbage", "slow", "reset")
RETRY_AFTER_S = 1
TIMEOUT_S = 0.5
RETRIES = 2  # 3 attempts
# The reason a failed verdict keeps for an episode whose last attempt met each fault.
REASONS = {"500": "backend: HTTP 500", "429": "backend: HTTP 429", "garbage": "backend: malformed reply",
           "slow": f"backend: timed out after {TIMEOUT_S:g}s", "reset": "backend: connection failed"}


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 drops connections when the judge opens 8 at once, and the
    # client sees a connect timeout that the endpoint never saw.
    request_queue_size = 128


class FaultyEndpoint:
    """`/v1/chat/completions` answering "Verdict: YES" when the predicted answer equals the answer
    key, else "Verdict: NO"; `fate(key, attempt)` decides which attempts fail and how. Every attempt is
    logged with its key (the episode's tag), attempt number, fault and arrival / answer times."""

    def __init__(self, seed: int = 0, rate: float = FAULT_RATE, retry_after: str = str(RETRY_AFTER_S),
                 script: dict | None = None):
        self.seed, self.rate, self.retry_after, self.script = seed, rate, retry_after, script
        self.log: list[dict] = []
        self._seen: dict = {}
        self._lock = threading.Lock()
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                arrived = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                user = body["messages"][-1]["content"]
                key = re.search(r"\[(ep\d+)\]", user).group(1)
                with endpoint._lock:
                    attempt = endpoint._seen[key] = endpoint._seen.get(key, -1) + 1
                    entry = dict(key=key, attempt=attempt, fault=endpoint.fate(key, attempt), arrived=arrived)
                    endpoint.log.append(entry)
                try:
                    endpoint.answer(self, entry["fault"], user, entry)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a slow body: that is the point of the fault

        self.server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def fate(self, key: str, attempt: int):
        if self.script is not None:
            return self.script.get(attempt)
        u = random.Random(f"{self.seed}/{key}/{attempt}").random()
        return KINDS[int(u / self.rate * len(KINDS))] if u < self.rate else None

    @staticmethod
    def verdict(user: str) -> str:
        predicted = re.search(r"<predicted>\n(.*?)\n</predicted>", user, re.DOTALL).group(1)
        key = re.search(r"<answer_key>\n(.*?)\n</answer_key>", user, re.DOTALL).group(1)
        return "Verdict: YES" if predicted.strip() == key.strip() else "Verdict: NO"

    def answer(self, handler, fault, user: str, entry: dict) -> None:
        payload = json.dumps({"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": self.verdict(user)}, "finish_reason": "stop"}]}
        ).encode()
        status, headers = 200, {}
        if fault == "reset":  # RST instead of a reply
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            handler.connection.close()
            handler.close_connection = True
            entry["answered"] = time.monotonic()
            return
        if fault == "500":
            status, payload = 500, b'{"error": {"message": "injected server error"}}'
        elif fault == "429":
            status, payload, headers = 429, b'{"error": {"message": "slow down"}}', {"Retry-After": self.retry_after}
        elif fault == "garbage":
            payload = b"\x00<html>502 Bad Gateway{{{"
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        entry["answered"] = time.monotonic()
        if fault != "slow":
            handler.wfile.write(payload)
            return
        for i in range(len(payload)):  # each byte well within the socket timeout, the whole far past it
            handler.wfile.write(payload[i:i + 1])
            handler.wfile.flush()
            time.sleep(TIMEOUT_S / 5)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _config(tmp_path, base_url: str, **judge):
    from configs import demo

    c = demo.get_config()
    c.workdir = str(tmp_path / "run")
    c.judge.cache_dir = str(tmp_path / "judge_cache")
    c.judge.outcome.update(dict(kind="http", base_url=base_url, model="stub", api_key_env="", votes=1,
                                timeout_s=TIMEOUT_S, retries=RETRIES, backoff_s=0.05, max_backoff_s=2.0, **judge))
    return c


def _trajectory(i: int) -> Trajectory:
    answer = "19" if i % 3 else "20"  # every third episode is wrong
    return Trajectory(id=f"ep{i}", query_id=f"q{i}", question=f"[ep{i}] What is 12 + 7?", prompt_text="",
                      prompt_ids=[], steps=[Step(f"<answer>{answer}</answer>", [], [], kind="answer")],
                      reference_answer="19", final_answer=answer, termination="answer")


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("judges")
    endpoint = FaultyEndpoint(seed=3)
    caplog_handler = _Retries()
    logger = logging.getLogger("steprl_jax.judges.http_backend")
    logger.addHandler(caplog_handler)
    try:
        judging = Judging.from_config(_config(tmp_path, endpoint.base_url), outcome_rule=lambda task, t: "false")
        trajectories = [_trajectory(i) for i in range(EPISODES)]
        started = time.monotonic()
        judging.judge([(None, t) for t in trajectories])
        wall_s = time.monotonic() - started
        store = RecordStore(tmp_path / "trajectories.jsonl")
        for trajectory in trajectories:
            store.append(trajectory)
    finally:
        logger.removeHandler(caplog_handler)
        endpoint.close()
    backend = judging.outcome_judge.backend.backend
    assert isinstance(backend, HttpChatBackend)
    return dict(endpoint=endpoint, records={r.id: r for r in store.load()}, backend=backend,
                retries=caplog_handler.records, wall_s=wall_s, judge=judging.outcome_judge)


class _Retries(logging.Handler):
    """The backend's "retry i/n in d s" lines: (reason, delay) as it chose them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []
        self.created = []  # when each line was logged (epoch seconds)

    def emit(self, record):
        _, reason, _, _, delay = record.args
        self.records.append((reason, delay))
        self.created.append(record.created)


def _attempts(log: list[dict]) -> dict:
    out = {}
    for entry in sorted(log, key=lambda e: e["attempt"]):
        out.setdefault(entry["key"], []).append(entry)
    return out


def test_every_episode_gets_a_verdict_or_a_failure_with_its_reason(judged):
    endpoint, records = judged["endpoint"], judged["records"]
    assert sorted(records) == sorted(f"ep{i}" for i in range(EPISODES))  # zero lost
    attempts = _attempts(endpoint.log)
    faults = {kind: sum(e["fault"] == kind for e in endpoint.log) for kind in KINDS}
    failed = 0
    for key, record in records.items():
        outcome = record.judgements["outcome"]
        tries = attempts[key]
        assert [e["attempt"] for e in tries] == list(range(len(tries)))
        if tries[-1]["fault"] is None:  # answered: a real verdict after the faults before it
            assert all(e["fault"] is not None for e in tries[:-1]) and len(tries) <= RETRIES + 1
            assert outcome["label"] == ("false" if int(key[2:]) % 3 == 0 else "true"), (key, outcome)
            assert outcome["failed_reason"] is None and outcome["judge"] == "http"
        else:  # every attempt failed: a failed verdict naming the last fault, never a guess
            failed += 1
            assert len(tries) == RETRIES + 1 and all(e["fault"] is not None for e in tries)
            assert outcome["label"] == "failed" and outcome["score"] is None
            assert outcome["failed_reason"].startswith(REASONS[tries[-1]["fault"]]), outcome
            assert outcome["failed_reason"].endswith(f"(after {RETRIES + 1} attempts)")
    print(f"attempts {len(endpoint.log)}, faults {faults}, failed verdicts {failed}, wall {judged['wall_s']:.1f}s")
    assert all(faults.values())  # the seed exercises every kind of fault
    assert failed >= 1  # ... and at least one episode whose every attempt failed
    assert judged["judge"].stats.snapshot()["failed/backend"] == failed


def test_retries_are_counted(judged):
    backend, log = judged["backend"], judged["endpoint"].log
    assert backend.stats["requests"] == EPISODES
    assert backend.stats["attempts"] == len(log)
    assert backend.stats["retries"] == len(log) - EPISODES == len(judged["retries"])
    assert backend.stats["retries"] == sum(e["fault"] is not None for e in log) - backend.stats["failures"]


def test_an_http_date_is_the_time_left_until_it():
    from steprl_jax.judges.http_backend import _retry_after

    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    ahead = formatdate((now + datetime.timedelta(seconds=2)).timestamp(), usegmt=True)
    assert _retry_after({"Retry-After": ahead}, now=now) == 2.0
    assert _retry_after({"Retry-After": formatdate(now.timestamp() - 60, usegmt=True)}, now=now) == 0.0
    assert _retry_after({"Retry-After": "Fri, 02 Jan 2026 03:04:07"}, now=now) == 2.0  # no zone: GMT
    assert _retry_after({"Retry-After": "soon"}, now=now) is None and _retry_after({}, now=now) is None


def test_retry_after_is_honoured(judged):
    """Each retry after a 429 waits Retry-After (below max_backoff_s, above our own short backoff)
    times a jitter of at most 10%, and every 429 is retried; retries after other faults use the
    short exponential backoff."""
    delays = [delay for reason, delay in judged["retries"] if reason.startswith("HTTP 429")]
    others = [delay for reason, delay in judged["retries"] if not reason.startswith("HTTP 429")]
    assert delays and all(RETRY_AFTER_S <= d <= RETRY_AFTER_S * 1.1 for d in delays), delays
    assert len(set(delays)) > 1  # jittered: threads told the same Retry-After do not retry in lockstep
    assert others and all(d <= 0.05 * 2 ** RETRIES for d in others)
    # every 429 was retried, after the chosen wait (the wall clock: benchmarks/retry_waits.py)
    retried = [this for tries in _attempts(judged["endpoint"].log).values()
               for this, _ in zip(tries, tries[1:]) if this["fault"] == "429"]
    assert len(retried) == len(delays)


CASES = ["capped", "date", "short", "zero", "past"]


@pytest.mark.parametrize("case", CASES)
def test_retry_after_is_capped_read_as_a_date_and_not_exceeded(case):
    """Retry-After 30 s is capped at max_backoff_s (0.3 s); an HTTP date means the time left until it
    when the backend read it; Retry-After 1 s is what is waited when our own backoff is shorter; and
    `Retry-After: 0` or a date already past still wait our floor, backoff_s x U(0.5, 1) (0.5 to 1 s
    here), never an immediate retry. Each wait is then stretched by at most 10% of jitter."""
    date = int(time.time()) + 3  # whole seconds, as an HTTP date has them
    value = {"capped": "30", "date": formatdate(date, usegmt=True), "short": "1", "zero": "0",
             "past": formatdate(time.time() - 60.0, usegmt=True)}[case]
    backoff_s, max_backoff_s = {"capped": (0.01, 0.3), "date": (0.01, 5.0), "short": (0.05, 30.0),
                                "zero": (1.0, 30.0), "past": (1.0, 30.0)}[case]
    endpoint = FaultyEndpoint(retry_after=value, script={0: "429"})
    retries, logger = _Retries(), logging.getLogger("steprl_jax.judges.http_backend")
    logger.addHandler(retries)
    asked = time.time()  # the date is read after this instant and before the retry is logged
    try:
        backend = HttpChatBackend(endpoint.base_url, "stub", timeout_s=TIMEOUT_S, retries=1, backoff_s=backoff_s,
                                  max_backoff_s=max_backoff_s)
        messages = [{"role": "user", "content": "[ep0] <predicted>\n1\n</predicted> <answer_key>\n1\n</answer_key>"}]
        assert backend.chat(messages, 1, 0.0, 5) == ["Verdict: YES"]
    finally:
        logger.removeHandler(retries)
        endpoint.close()
    # The wait the backend chose (its log line), not the measured gap: a loaded host stretches the
    # gap, never the choice (the gap itself: python -m steprl_jax.benchmarks.retry_waits).
    ((_, delay),) = retries.records
    # The date's wait is bounded by the instants around its reading, not by how long they took.
    low, high = {"capped": (0.3, 0.33), "date": (date - retries.created[0], (date - asked) * 1.1),
                 "short": (1.0, 1.1), "zero": (0.5, 1.1), "past": (0.5, 1.1)}[case]
    assert low <= delay <= high, delay
    assert [e["fault"] for e in endpoint.log] == ["429", None]  # one retry, answered
