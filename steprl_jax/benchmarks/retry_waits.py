"""How long the HTTP judge backend really waits after a 429, against the wait it chose.

    python -m steprl_jax.benchmarks.retry_waits [--repeats 5] [--retry-after 1] [--json PATH]

A real endpoint on 127.0.0.1 answers each request's first attempt with 429 and `Retry-After`,
the second with a verdict. Per request: the delay the backend chose (its "retry i/n in d s" log
line) and the gap the endpoint saw between its 429 and the retry. The ratio gap / chosen is
printed; below 1 the backend retried sooner than it said. The tests check the chosen delay
(tests/test_faults_judges.py); this measures the wall clock, which a loaded host stretches.
"""
from __future__ import annotations

import argparse
import http.server
import json
import logging
import threading
import time


def measure(repeats: int, retry_after: str) -> list[dict]:
    from steprl_jax.judges.http_backend import HttpChatBackend

    seen = []  # (arrived, answered) per attempt

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            arrived = time.monotonic()
            if len(seen) % 2 == 0:
                status, body, headers = 429, b'{"error": {"message": "slow down"}}', {"Retry-After": retry_after}
            else:
                status, headers = 200, {}
                body = json.dumps({"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "Verdict: YES"}}]}).encode()
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            seen.append((arrived, time.monotonic()))

        def log_message(self, *args):
            pass

    chosen = []

    class Delays(logging.Handler):
        def emit(self, record):
            chosen.append(float(record.args[-1]))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    logger, handler = logging.getLogger("steprl_jax.judges.http_backend"), Delays(logging.WARNING)
    logger.addHandler(handler)
    try:
        backend = HttpChatBackend(f"http://127.0.0.1:{server.server_port}/v1", "stub", timeout_s=10.0, retries=1,
                                  backoff_s=0.01, max_backoff_s=30.0)
        for _ in range(repeats):
            backend.chat([{"role": "user", "content": "2 + 2?"}], 1, 0.0, 5)
    finally:
        logger.removeHandler(handler)
        server.shutdown()
    gaps = [seen[2 * i + 1][0] - seen[2 * i][1] for i in range(repeats)]
    return [{"chosen_s": c, "gap_s": g, "ratio": g / c} for c, g in zip(chosen, gaps)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--retry-after", default="1")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = measure(a.repeats, a.retry_after)
    for row in rows:
        print(f"chosen {row['chosen_s']:.3f} s  gap {row['gap_s']:.3f} s  gap / chosen {row['ratio']:.3f}")
    low = min(r["ratio"] for r in rows)
    print(f"lowest gap / chosen: {low:.3f} ({'never sooner than chosen' if low >= 1 else 'SOONER than chosen'})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "min_ratio": low}, f, indent=1)


if __name__ == "__main__":
    main()
