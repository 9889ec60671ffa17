"""A known fake API key never leaks: each job that can hold one runs for real with it (SWiRL with an
http process judge and reward model, online RL with an http outcome judge and its reply cache, the
server with bearer authentication), and every file the run wrote, and everything it printed, is
searched for the key's bytes.

The judge endpoint (tests/chat_stub.py) checks the key and, every few requests, fails with a body
that echoes the Authorization header it got, as a careless server would: the failure reasons that
reach logs and records must not carry the key back.
"""
import json
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from chat_stub import ChatStub
from rl_helpers import TOOLS_FLAG, verdict_reply
from steprl_jax.models import export_hf
from swirl_helpers import smol_tokenizer, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY_ENV = "STEPRL_TEST_SECRET_KEY"
KEY = "sk-steprl-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    tokenizer = smol_tokenizer()
    model_dir = export_hf(tiny_model(tokenizer, seed=3), tokenizer, str(folder / "model"))
    env = {**os.environ, KEY_ENV: KEY, "JAX_PLATFORMS": "cpu"}
    yield model_dir, env


def _leaks(folder: str, *outputs: str) -> list[str]:
    """The files under `folder` (bytes, binary ones included) and outputs that contain the key."""
    needle = KEY.encode()
    found = [f"output {i}" for i, text in enumerate(outputs) if KEY in text]
    scanned = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                if needle in f.read():
                    found.append(path)
            scanned += 1
    assert scanned > 0, f"nothing was written under {folder}"
    return found


def _run(command, env, cwd=ROOT) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def _judge(section: str, base_url: str, *extra: str) -> list[str]:
    return [f"--config.{section}.kind=http", f"--config.{section}.base_url={base_url}",
            f"--config.{section}.model=stub", f"--config.{section}.api_key_env={KEY_ENV}",
            *(f"--config.{section}.{setting}" for setting in extra)]


def test_swirl_with_http_judge_and_reward_model_never_writes_the_key(setup, tmp_path):
    model_dir, env = setup
    stub = ChatStub(lambda body, i: "Verdict: GOOD", api_key=KEY, echo_auth_every=3)
    try:
        workdir = str(tmp_path / "swirl")
        output = _run([sys.executable, "-m", "steprl_jax.main", "--config=configs/swirl_arithmetic.py",
                       f"--config.model.source={model_dir}", f"--config.workdir={workdir}",
                       "--config.progress=False", "--config.stages=collect,judge,filter,train", "--config.task.num_tasks=2",
                       "--config.rollout.max_new_tokens=12", "--config.rollout.max_steps=2",
                       "--config.swirl.samples_per_question=2", "--config.swirl.filter=none",
                       "--config.swirl.train.updates=1", "--config.swirl.train.batch_size=2",
                       "--config.swirl.train.group_size=2", f"--config.judge.cache_dir={tmp_path / 'swirl_cache'}",
                       *_judge("judge.process", stub.base_url), *_judge("reward", stub.base_url, "retries=1"),
                       "--config.reward.scale=binary"], env)
    finally:
        stub.close()
    assert len(stub.requests) >= 4  # the judges and the reward model really called the endpoint
    assert "Bearer ***" in output  # an echoed key came back in a failure reason, scrubbed
    assert not _leaks(str(tmp_path), output)


def test_online_rl_with_http_outcome_judge_never_writes_the_key(setup, tmp_path):
    model_dir, env = setup
    stub = ChatStub(lambda body, i: verdict_reply(body), api_key=KEY, echo_auth_every=3)
    try:
        workdir = str(tmp_path / "rl")
        output = _run([sys.executable, "-m", "steprl_jax.main", "--config=configs/portool_toolworld.py",
                       "--config.algorithm=grpo", f"--config.model.source={model_dir}",
                       f"--config.workdir={workdir}", "--config.progress=False", "--config.task.num_tasks=4",
                       "--config.rollout.max_new_tokens=8", "--config.rollout.max_steps=2",
                       "--config.rollout.max_context=2048", "--config.rollout.tree.n=2",
                       "--config.rl.iterations=1", "--config.rl.queries_per_iteration=2", "--config.rl.eval_every=1",
                       "--config.rl.eval.num_tasks=2", "--config.rl.eval.votes=1", TOOLS_FLAG,
                       f"--config.judge.cache_dir={tmp_path / 'rl_cache'}", "--config.judge.outcome.votes=1",
                       *_judge("judge.outcome", stub.base_url, "retries=1", "backoff_s=0.01")], env)
    finally:
        stub.close()
    assert len(stub.requests) >= 4
    assert "Bearer ***" in output
    assert not _leaks(str(tmp_path), output)


def test_server_bearer_token_never_printed(setup, tmp_path):
    model_dir, env = setup
    server = subprocess.Popen([sys.executable, "-m", "steprl_jax.serve", "--model", model_dir, "--port", "0",
                               "--api-key-env", KEY_ENV, "--log-level", "DEBUG", "--max-context", "256"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = server.stdout.readline()
        while line and "serving" not in line:
            line = server.stdout.readline()
        url = line.split(" at ")[-1].strip()
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()

        def post(key):
            request = urllib.request.Request(url + "/chat/completions", data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    return reply.status, reply.read().decode()
            except urllib.error.HTTPError as error:
                return error.code, error.read().decode()

        status, text = post(KEY)
        assert status == 200, text
        wrong = KEY[:-1] + ("0" if KEY[-1] != "0" else "1")  # off by one character
        status, text = post(wrong)
        assert status == 401 and KEY not in text and wrong not in text, text
    finally:
        server.terminate()
        output = server.communicate(timeout=60)[0]
    assert "POST" in output  # the request log is there, without headers or bodies
    assert KEY not in output
