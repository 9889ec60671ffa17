"""A tool-world outcome judge served over HTTP on 127.0.0.1, answering after a set latency: an
OpenAI-compatible `/v1/chat/completions` that reads PORTool's verdict prompt
(`judges.prompts.trajectory_messages`: the reference, the trajectory with its tool calls and
results) and answers "Verdict: true / false / unable_to_answer" by the tool world's own rule
(`judges.rules.toolworld_outcome`), as a remote LLM judge of a benchmark would, in its time.

    with VerdictServer(latency_s=1.0) as server:
        config.judge.outcome.base_url = server.base_url
"""
from __future__ import annotations

import http.server
import json
import re
import threading
import time
from typing import Optional

from steprl_jax.judges import rules
from steprl_jax.tools.formats import parse_tool_call_step
from steprl_jax.tools.protocol import TOOL_FAILURE

_REFERENCE = re.compile(r"<reference>\n(.*?)\n</reference>", re.DOTALL)
_TRAJECTORY = re.compile(r"<trajectory>\n(.*?)\n</trajectory>", re.DOTALL)
_MESSAGE = re.compile(r"(?m)^\[(assistant|tool)\]\n")  # judges.prompts.render_history's labels


def final_answer(trajectory: str) -> Optional[str]:
    """The answer of the trajectory's last response_gen call (its assistant messages parsed as the
    tool-call format), None without one."""
    parts = _MESSAGE.split(trajectory)
    for role, text in reversed(list(zip(parts[1::2], parts[2::2]))):
        if role != "assistant":
            continue
        for call in reversed(parse_tool_call_step(text.strip()).calls):
            if call.name == "response_gen" and isinstance(call.arguments, dict) and "answer" in call.arguments:
                return str(call.arguments["answer"])
    return None


def verdict(messages: list) -> str:
    """The verdict line for one request's messages (false when the prompt is not PORTool's)."""
    user = next((m.get("content", "") for m in messages if m.get("role") == "user"), "")
    reference, trajectory = _REFERENCE.search(user or ""), _TRAJECTORY.search(user or "")
    if reference is None or trajectory is None:
        return "Verdict: false"
    label = rules.toolworld_outcome(final_answer(trajectory.group(1)), reference.group(1),
                                    f'"{TOOL_FAILURE}"' in trajectory.group(1))
    return f"Verdict: {label}"


class VerdictServer:
    """The server on a free port of 127.0.0.1, one thread per connection; `latency_s` per answer."""

    def __init__(self, latency_s: float = 1.0):
        latency = float(latency_s)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                time.sleep(latency)
                reply = verdict(body.get("messages", []))
                data = json.dumps({"choices": [{"index": i, "message": {"role": "assistant", "content": reply},
                                                "finish_reason": "stop"} for i in range(int(body.get("n", 1)))]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
