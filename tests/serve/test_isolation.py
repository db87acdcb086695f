"""What needs the engine held still to be tested without timing: the queue limit (503 with
Retry-After), a client that leaves (its request aborted, its slots reused), a request whose
drafter raises (it fails alone) and an engine that dies (503 from then on).

These servers run in this process (uvicorn in a thread, still reached over loopback by the
official client), so a step observer can hold the engine in the middle of a step.
"""

from __future__ import annotations

import json
import threading

import openai
import pytest
import uvicorn

from multispec import LLM, AsyncLLM, SpecConfig
from multispec.drafters import DRAFTERS, ConsensusDrafter
from multispec.serve.app import ServerConfig, build_app
from tests.serve.conftest import Server, free_port, wait_ready

SPEC = SpecConfig(drafter="consensus", adaptive=False)


class Gate:
    """A step observer that holds the engine thread in its decode steps while closed."""

    def __init__(self):
        self.open = threading.Event()
        self.entered = threading.Event()

    def __call__(self, report) -> None:
        self.entered.set()
        self.open.wait(timeout=60)


class ThreadServer:
    """uvicorn serving ``build_app`` in a thread of this process; ``engine`` is reachable."""

    def __init__(self, successor_dir, **config):
        self.async_llm = AsyncLLM(LLM(str(successor_dir), device="cpu", dtype="float32", kv_cache_memory=0.05,
                                      spec=SPEC))
        self.engine = self.async_llm.engine
        self.http = Server(f"http://127.0.0.1:{free_port()}", "tiny")
        port = int(self.http.base_url.rsplit(":", 1)[1])
        app = build_app(self.async_llm, ServerConfig("tiny", **config))
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_ready(self.http)
        return self

    def __exit__(self, *exc):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)

    def client(self):
        return openai.OpenAI(base_url=self.http.base_url + "/v1", api_key="none", max_retries=0, timeout=60)

    def idle(self) -> bool:
        return not self.engine.has_unfinished_requests() and not self.engine.scheduler.slots


@pytest.fixture(scope="module")
def held(successor_dir):
    with ThreadServer(successor_dir, max_queued_requests=1) as server:
        yield server


def test_full_queue_is_503_and_a_client_that_leaves_aborts_its_request(held):
    gate = Gate()
    held.engine.step_observers.append(gate)
    client = held.client()
    try:
        stream = client.completions.create(model="tiny", prompt="The lazy dog", n=2, max_tokens=100, stream=True,
                                           extra_body={"ignore_eos": True})
        assert gate.entered.wait(timeout=30)  # admitted, prefilled, held in its first decode step: still waiting
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "overloaded"
        assert caught.value.response.headers["Retry-After"] == "1"
        stream.close()
        aborted = 'multispec_requests_total{endpoint="/v1/completions",outcome="aborted"}'
        held.http.wait_until(lambda: held.http.metrics().get(aborted) == 1.0, "the abort to be counted")
    finally:
        gate.open.set()
        held.engine.step_observers.remove(gate)
    held.http.wait_until(held.idle, "the aborted request to leave the engine")
    assert held.engine.stats.generated_tokens < 2 * 100
    out = client.completions.create(model="tiny", prompt="The lazy dog", n=4, max_tokens=100,
                                    extra_body={"ignore_eos": True})
    assert [len(c.text) > 0 for c in out.choices] == [True] * 4 and out.usage.completion_tokens == 400


def test_auto_tool_choice_needs_a_parser(held):
    """Without --enable-auto-tool-choice and --tool-call-parser (this server has neither), tools
    with tool_choice "auto" (the default with tools) are refused with 400 naming tool_choice and
    the flags, as vLLM refuses them."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as caught:
            held.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2, tools=[tool], **extra)
        assert caught.value.body["param"] == "tool_choice"


class ExplodingDrafter(ConsensusDrafter):
    def propose(self, *args, **kwargs):
        raise RuntimeError("the drafter broke")


def test_a_request_whose_drafter_raises_fails_alone(successor_dir, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "exploding", ExplodingDrafter)
    with ThreadServer(successor_dir) as server:
        check_drafter_failure_is_isolated(server)


def check_drafter_failure_is_isolated(held: ThreadServer) -> None:
    client = held.client()
    broken = dict(model="tiny", prompt="The lazy dog", n=4, max_tokens=50,
                  extra_body={"ignore_eos": True, "speculation": {"drafter": "exploding"}})
    results = {}

    def run(name, call):
        try:
            results[name] = call()
        except Exception as error:  # noqa: BLE001 - the test looks at it
            results[name] = error

    calls = {
        "healthy": lambda: client.completions.create(model="tiny", prompt="The quick brown fox", n=8, max_tokens=60,
                                                     extra_body={"ignore_eos": True}),
        "broken": lambda: client.completions.create(**broken),
        "broken-stream": lambda: held.http.request("POST", "/v1/completions", {
            "model": "tiny", "prompt": "The lazy dog", "n": 4, "max_tokens": 50, "stream": True,
            "ignore_eos": True, "speculation": {"drafter": "exploding"}}),
    }
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert isinstance(results["broken"], openai.InternalServerError)
    assert results["broken"].body["code"] == "request_failed" and "drafter broke" in results["broken"].body["message"]
    status, _, body = results["broken-stream"]
    events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_failed"
    healthy = results["healthy"]
    assert len(healthy.choices) == 8 and healthy.usage.completion_tokens == 8 * 60
    held.http.wait_until(held.idle, "every request to leave the engine")
    assert held.http.request("GET", "/health")[0] == 200


def test_a_dead_engine_is_503_on_health_and_requests(successor_dir):
    def crash(report):
        raise RuntimeError("the device fell over")

    with ThreadServer(successor_dir) as server:
        server.engine.step_observers.append(crash)
        client = server.client()
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           extra_body={"ignore_eos": True})
        assert caught.value.status_code == 503 and caught.value.body["code"] == "engine_dead"
        status, _, body = server.http.request("GET", "/health")
        assert status == 503 and json.loads(body)["error"]["code"] == "engine_dead"
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="tiny", prompt="hi")
        assert caught.value.status_code == 503
        assert server.http.metrics()["multispec_engine_healthy"] == 0.0
