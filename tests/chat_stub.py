"""A real OpenAI chat-completions endpoint on 127.0.0.1 for judge and reward-model tests.

    stub = ChatStub(lambda body, i: "Verdict: GOOD")     # reply for choice i of a request body
    ...HttpChatBackend(base_url=stub.base_url, ...)...
    stub.requests                                         # every request body received
    stub.close()

`status` != 200 answers every request with that HTTP error; `jitter_s` delays each answer by a
random amount up to it, so that concurrent requests finish out of order. `api_key` makes it answer
401 to a request without `Authorization: Bearer <api_key>`; `echo_auth_every=k` makes every k-th
request fail with 500 and a body that echoes the Authorization header it got, as a careless server
would (for tests that keys never leak through error reasons).
"""
import http.server
import json
import random
import threading


class ChatStub:
    def __init__(self, reply=lambda body, i: "Verdict: GOOD", status: int = 200, jitter_s: float = 0.0,
                 api_key: str | None = None, echo_auth_every: int = 0):
        self.reply, self.status, self.jitter_s = reply, status, jitter_s
        self.api_key, self.echo_auth_every = api_key, echo_auth_every
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append(body)
                    count = len(stub.requests)
                if stub.jitter_s:
                    threading.Event().wait(random.uniform(0.0, stub.jitter_s))
                auth = self.headers.get("Authorization", "")
                status = stub.status
                if stub.api_key is not None and auth != f"Bearer {stub.api_key}":
                    status, payload = 401, json.dumps({"error": {"message": f"bad key {auth!r}"}}).encode()
                elif stub.echo_auth_every and count % stub.echo_auth_every == 0:
                    status, payload = 500, json.dumps({"error": {"message": f"failed for {auth}"}}).encode()
                elif status != 200:
                    payload = b'{"error": {"message": "injected"}}'
                else:
                    payload = json.dumps({"object": "chat.completion", "choices": [
                        {"index": i, "message": {"role": "assistant", "content": stub.reply(body, i)},
                         "finish_reason": "stop"} for i in range(body.get("n", 1))]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
