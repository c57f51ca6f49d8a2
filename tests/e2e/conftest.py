"""Fixtures that run the real `lily serve` binary on loopback for the SDK tests.

The binary comes from $LILY_BIN (scripts/test-e2e.sh and scripts/test.sh set
it), else target/debug/lily. Every server serves the built-in demo
checkpoint (random weights, made once per session into a temporary
XDG_CACHE_HOME) on a free 127.0.0.1 port, and is stopped by its own pid at
the end. Servers:

- `main`: default limits, plus --test-script-file with SCRIPT_RULES, so that
  prompts carrying one of the E2E-* markers get a scripted reply (see
  lily_server::scripted: the request still goes through the real engine, and
  only the generated tokens are replaced). Everything else is the model.
- `strict`: small limits, an API key from the LILY_API_KEY environment
  variable, CORS on: the error and limit cases.
"""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
MODEL = "lily-demo"
STRICT_KEY = "e2e-secret-key"

# Scripted replies (first matching rule wins). The tool-call reply is
# exactly what Qwen3.6 writes: thinking, then the XML call, then <|im_end|>.
SCRIPT_RULES = [
    {
        "when_prompt_contains": "<tool_response>\nSunny, 21 C",
        "reply": "The tool answered.\n</think>\n\nIt is sunny and 21 C in Paris.<|im_end|>",
    },
    {
        "when_prompt_contains": "E2E-TOOL-QUESTION",
        "reply": "I should call the weather tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>",
    },
    {
        "when_prompt_contains": "E2E-THINK",
        "reply": "Step one: add.\nStep two: done.\n</think>\n\nThe answer is 4.<|im_end|>",
    },
]


def lily_bin() -> Path:
    env = os.environ.get("LILY_BIN")
    path = Path(env) if env else REPO / "target" / "debug" / "lily"
    if not path.is_file():
        pytest.exit(f"lily binary not found at {path}; build it with `cargo build -p lily` (scripts/test-e2e.sh does)", 2)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `lily serve` process."""

    def __init__(self, name, args, cache_dir, log_dir, env_extra=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ)
        env["XDG_CACHE_HOME"] = str(cache_dir)
        env.setdefault("RUST_LOG", "info")
        env.update(env_extra or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(lily_bin()), "serve", "--bind", f"127.0.0.1:{self.port}", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.wait_ready()

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout=180.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lily serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"lily serve did not become ready in {timeout}s:\n{self.log_text()}")

    def metric(self, name, headers=None) -> float:
        """The value of an unlabelled metric from /metrics."""
        text = requests.get(self.base + "/metrics", headers=headers, timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(f"{name} not in /metrics")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM to this pid: the server drains and exits.
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def main_server(cache_dir, log_dir, tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "script.json"
    script.write_text(json.dumps({"rules": SCRIPT_RULES}))
    server = Server("main", ["--test-script-file", str(script), "--max-concurrent", "16"], cache_dir, log_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def strict_server(cache_dir, log_dir, main_server):
    # `main_server` first: it makes the demo checkpoint this one reuses.
    server = Server(
        "strict",
        [
            "--max-seq", "512",
            "--max-body-bytes", "4000",
            "--max-messages", "4",
            "--max-concurrent", "1",
            "--max-queue", "1",
            "--request-timeout-s", "1",
            "--cors",
        ],
        cache_dir,
        log_dir,
        env_extra={"LILY_API_KEY": STRICT_KEY},
    )
    yield server
    server.stop()


@pytest.fixture()
def client(main_server):
    from openai import OpenAI

    return OpenAI(base_url=main_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def strict_client(strict_server):
    from openai import OpenAI

    return OpenAI(base_url=strict_server.base + "/v1", api_key=STRICT_KEY, max_retries=0, timeout=60)
