"""One ``multispec serve`` process on the tiny successor model for the whole of tests/serve (it
starts in a few seconds and serves every test), and helpers to reach it.

The server runs with an API key and small limits so that the refusals can be tested against the
same process; its default speculation is the command line's (the consensus drafter).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message

import pytest

API_KEY = "test-key"
MAX_N = 16
MAX_TOKENS = 200
MAX_REQUEST_BYTES = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    model: str
    process: subprocess.Popen | None = None

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict | None = None) -> tuple[int, Message, bytes]:
        """(status, headers (case-insensitive), body) of one plain HTTP request (errors included)."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=all_headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name and labels, as in the text format: {'name{labels}': value}."""
        _, _, text = self.request("GET", "/metrics")
        samples = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_until(self, predicate, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)


def wait_ready(server: Server, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process is not None and server.process.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.process.returncode}")
        try:
            if server.request("GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become healthy in time")


@pytest.fixture(scope="session")
def server(successor_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MULTISPEC_API_KEY": API_KEY}
    command = [sys.executable, "-m", "multispec.cli", "serve", str(successor_dir), "--port", str(port),
               "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "0.25", "--served-model-name", "tiny",
               "--max-n", str(MAX_N), "--max-tokens-limit", str(MAX_TOKENS),
               "--max-request-bytes", str(MAX_REQUEST_BYTES), "--enable-auto-tool-choice", "--tool-call-parser",
               "hermes", "--log-level", "warning"]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=stderr, stderr=subprocess.STDOUT, env=env)
    running = Server(f"http://127.0.0.1:{port}", "tiny", process)
    try:
        wait_ready(running)
        yield running
    except RuntimeError as error:
        raise RuntimeError(f"{error}\n{log.read_text()}") from None
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def async_client(server):
    import openai

    return lambda: openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
