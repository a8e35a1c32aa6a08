"""A malformed request is refused before its Model is asked for: to a Model at
zero replicas it is a 400 at once, and the Model never starts loading.

Every generation route reads and checks the whole body (fields, messages or
input, tools, tool_choice, content parts) first, and only then waits for the
engine, whose tokenizer renders the prompt. Against a real daemon whose Model
is at ``minReplicas: 0``: after every malformed request its phase is still
``Idle``, no ``Loading`` event was recorded, and ``specd_model_load_seconds``
counted no load; then one good request loads it, so the same checks see a load.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import model_manifest, start_daemon
from daemons import scrape, wait_for

MODEL = "lazy"
ADMIN = "/apis/specd.dev/v1alpha1"
USER = [{"role": "user", "content": "hi"}]
BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

# (route, body, the field the 400 names: OpenAI's param, or the start of Anthropic's message)
MALFORMED = [
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}], "stream": True},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0].image_url"),
    ("/v1/chat/completions", {"messages": USER, "tools": BAD_TOOL}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": USER, "tools": TOOL, "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": USER, "tools": TOOL, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stop": [1]}, "stop"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, "messages[0].content[0]"),
    ("/v1/messages", {"max_tokens": 8, "messages": USER, "tools": [{"name": "f", "input_schema": "x"}]},
     "tools.0.input_schema"),
    ("/v1/messages", {"max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/responses", {"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input[0].role"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 5}]},
     "tools[0].parameters"),
    ("/v1/responses", {"input": "hi", "stream": True, "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
                       "text": {"format": {"type": "json_object"}}}, "text.format"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": {"$ref": "#/nowhere"}}}}, "text.format.schema"),
]


@pytest.fixture(scope="module")
def idle_daemon(forged, tmp_path_factory):
    """A daemon whose one Model is at zero replicas (it loads on demand)."""
    manifest = model_manifest(MODEL, forged / "target", scaling="{minReplicas: 0}")
    daemon = start_daemon(tmp_path_factory.mktemp("idle"), {"models.yaml": manifest})
    wait_for(lambda: phase(daemon) == "Idle", what="the Model at zero")
    yield daemon
    daemon.stop()


def phase(daemon) -> str | None:
    status, body = daemon.get(f"{ADMIN}/models/{MODEL}")
    assert status == 200, body
    return json.loads(body).get("status", {}).get("phase")


def loading_events(daemon) -> list[dict]:
    status, body = daemon.get(f"{ADMIN}/models/{MODEL}/events")
    assert status == 200, body
    return [e for e in json.loads(body)["items"] if e["reason"] == "Loading"]


def loads_counted(daemon) -> float:
    return scrape(daemon).get(("specd_model_load_seconds_count", (("model_name", MODEL),)), 0.0)


@pytest.mark.parametrize("route,body,field", MALFORMED, ids=[f"{r}:{f}" for r, _, f in MALFORMED])
def test_a_malformed_request_to_an_idle_model_is_a_400_that_loads_nothing(idle_daemon, route, body, field):
    assert phase(idle_daemon) == "Idle", "an earlier request loaded the Model"
    status, payload = idle_daemon.get(route, {"model": MODEL, **body})  # its 10 s timeout: no wait for a load
    assert status == 400, payload
    error = json.loads(payload)
    if route.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert error["error"]["message"].startswith(field), error
    else:
        assert error["error"]["param"] == field, error
    assert phase(idle_daemon) == "Idle"
    assert loading_events(idle_daemon) == []
    assert loads_counted(idle_daemon) == 0


def test_a_good_request_then_loads_the_model(idle_daemon):
    """The checks above would see a load: a well-formed request to the same Model starts one."""
    assert phase(idle_daemon) == "Idle"
    request = urllib.request.Request(idle_daemon.url + "/v1/messages/count_tokens",
                                     json.dumps({"model": MODEL, "messages": USER}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:  # it waits for the load
        assert json.loads(response.read())["input_tokens"] > 0
    assert len(wait_for(lambda: loading_events(idle_daemon), what="the Loading event")) == 1
    assert loads_counted(idle_daemon) == 1
    assert phase(idle_daemon) == "Ready"
