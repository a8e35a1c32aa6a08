"""Hostile and careless input: every case answers a clear 4xx in its route's
shape, the daemon keeps serving, and nothing of a refused apply is stored.
A seeded, bounded ``hypothesis`` fuzz suite covers the OpenAI and Anthropic
routes, the admin API, ``specd apply -f`` and the watched directory."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import anthropic
import openai
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import model_manifest, start_daemon
from specd.api.text import lone_surrogate_path
from daemons import specd, wait_for

ADMIN = "/apis/specd.dev/v1alpha1"
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


TALLY: Counter = Counter()  # (route, status) of every body this module sent, printed at the end
HOSTILE: Counter = Counter()  # fuzzed inputs holding lone surrogates or YAML aliases, printed at the end


def post(url: str, body: bytes, headers: dict | None = None, timeout: float = 60) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    route = urllib.parse.urlsplit(url).path
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            TALLY[route, r.status] += 1
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as err:
        TALLY[route, err.code] += 1
        return err.code, err.read(), dict(err.headers)


def put(url: str, obj: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(obj).encode(), method="PUT",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def openai_error(status: int, raw: bytes) -> dict:
    body = json.loads(raw)
    assert 400 <= status < 500, (status, raw[:300])
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
    return body["error"]


def k8s_status(status: int, body: dict) -> dict:
    assert 400 <= status < 500, (status, body)
    assert body["kind"] == "Status" and body["code"] == status and isinstance(body["message"], str), body
    return body


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


# -- each case the issue measured ---------------------------------------------------


@pytest.mark.parametrize("raw,field", [
    (b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"model": "tiny", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    (json.dumps(chat_body(messages=[{"role": "user", "content": 5}])).encode(), "messages[0].content"),
    (json.dumps(chat_body(messages=[{"role": "user", "content": {"a": 1}}])).encode(), "messages[0].content"),
    (json.dumps(chat_body(stream="yes")).encode(), "stream"),
    (json.dumps(chat_body(frobnicate=True)).encode(), "frobnicate"),
    (json.dumps(chat_body(user=["x"])).encode(), "user"),
    (b"\xff\xfe{}", None),
])
def test_bad_chat_bodies_are_400s_that_name_the_field(daemon, raw, field):
    status, body, _ = post(daemon.url + "/v1/chat/completions", raw)
    error = openai_error(status, body)
    assert status == 400 and error["param"] == field, error


LONE = "\ud800x"  # json.dumps writes it as the escape "\\ud800", which JSON allows and Python decodes
TOOL = {"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "get", "description": "d", "input_schema": {"type": "object"}}
SURROGATE_CASES = [
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "\ud800x"}]), "messages[0].content"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "\udfff"}]), "messages[0].content"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
     "messages[0].content[0].text"),
    ("/v1/chat/completions", chat_body(stop=["a", LONE]), "stop[1]"),
    ("/v1/chat/completions", chat_body(tools=[{**TOOL, "function": {**TOOL["function"], "name": LONE}}]),
     "tools[0].function.name"),
    ("/v1/chat/completions", chat_body(tools=[{**TOOL, "function": {**TOOL["function"], "description": LONE}}]),
     "tools[0].function.description"),
    ("/v1/chat/completions", chat_body(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "get", "arguments": LONE}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {LONE: {"type": "string"}}}}}),
     "response_format.json_schema.schema.properties.\\ud800x"),
    ("/v1/completions", {"model": "tiny", "prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "system": LONE,
                      "messages": [{"role": "user", "content": "hi"}]}, "system"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "tools": [{**ANTHROPIC_TOOL, "name": LONE}],
                      "messages": [{"role": "user", "content": "hi"}]}, "tools[0].name"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "stop_sequences": [LONE],
                      "messages": [{"role": "user", "content": "hi"}]}, "stop_sequences[0]"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get", "input": {"q": LONE}}]}]},
     "messages[1].content[0].input.q"),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/responses", {"model": "tiny", "input": LONE}, "input"),
    ("/v1/responses", {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}]},
     "input[0].content[0].text"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "instructions": LONE}, "instructions"),
    (ADMIN + "/apply", {"items": [{"apiVersion": "specd.dev/v1alpha1", "kind": "SpecPolicy",
                                   "metadata": {"name": "lone"}, "spec": {"selector": {}, "mode": LONE}}]},
     "items[0].spec.mode"),
]


@pytest.mark.parametrize("route,body,field", SURROGATE_CASES)
def test_lone_surrogates_are_400s_that_name_the_field_on_every_route(daemon, route, body, field):
    before = stored(daemon)
    status, raw, _ = post(daemon.url + route, json.dumps(body).encode())
    assert status == 400, (status, raw[:300])
    reply = json.loads(raw)
    if route.startswith(ADMIN):
        assert k8s_status(status, reply)["details"]["causes"][0]["field"] == field, reply
    elif route.startswith("/v1/messages"):
        assert reply["type"] == "error" and reply["error"]["message"].startswith(field + ": "), reply
    else:
        assert openai_error(status, raw)["param"] == field
    assert "surrogate" in raw.decode() and stored(daemon) == before


def test_a_lone_surrogate_in_an_admin_put_or_a_url_is_refused(daemon):
    doc = {"apiVersion": "specd.dev/v1alpha1", "kind": "SpecPolicy", "metadata": {"name": "lone"},
           "spec": {"selector": {"matchLabels": {"app": LONE}}}}
    status, body = put(daemon.url + ADMIN + "/specpolicies/lone", doc)
    assert status == 400 and k8s_status(status, body)["details"]["causes"][0]["field"] == \
        "spec.selector.matchLabels.app"
    # a URL's percent-escapes that are not UTF-8 stay escaped (yarl): a name nothing has
    for path in ("/specpolicies/%ED%A0%80", "/%ED%A0%80", "/models/%ED%A0%80%ff"):
        status, raw = daemon.get(ADMIN + path)
        assert status == 404 and k8s_status(status, json.loads(raw))
    assert json.loads(daemon.get(ADMIN + "/models/%ED%A0%80/events")[1]) == {"items": []}
    status, raw = daemon.get("/v1/models/%ED%A0%80")
    assert status == 404 and openai_error(status, raw)["code"] == "model_not_found"


@pytest.mark.parametrize("prompt", [5, [1.5], {"text": "x"}, [["a"]], None, True])
def test_non_string_prompts_are_400s(daemon, prompt):
    status, body, _ = post(daemon.url + "/v1/completions",
                           json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode())
    assert status == 400 and openai_error(status, body)["param"] == "prompt"


def test_a_bogus_charset_is_415_and_an_oversized_body_413(daemon):
    status, body, _ = post(daemon.url + "/v1/chat/completions", json.dumps(chat_body()).encode(),
                           {"Content-Type": "application/json; charset=bogus"})
    assert status == 415 and "charset" in openai_error(status, body)["message"]
    status, body, _ = post(daemon.url + "/v1/chat/completions", b" " * (17 * 1024 * 1024))
    assert status == 413 and openai_error(status, body)
    status, body, _ = post(daemon.url + "/v1/messages", b"[" * 100_000)
    assert status == 400 and json.loads(body)["type"] == "error"


def test_completion_logprobs_parse_with_the_openai_client(client):
    for n in (0, 2):
        out = client.completions.create(model="tiny", prompt="def f(", max_tokens=3, logprobs=n, temperature=0)
        assert len(out.choices[0].logprobs.top_logprobs) == 3
        assert all(len(top) == n for top in out.choices[0].logprobs.top_logprobs)


def test_health_answers_while_a_huge_prompt_is_handled(daemon):
    """Templates and tokenizers run off the event loop: health checks keep being answered
    while one request's prompt is rendered and tokenized (counted, not timed)."""
    huge = json.dumps(chat_body(messages=[{"role": "user", "content": "def f(x):\n    return x\n" * 120_000}]))
    result: dict = {}
    sender = threading.Thread(target=lambda: result.update(
        reply=post(daemon.url + "/v1/chat/completions", huge.encode())))
    sender.start()
    answered = 0
    while sender.is_alive():
        assert daemon.get("/healthz")[0] == 200
        answered += 1
        time.sleep(0.02)
    sender.join()
    status, body, _ = result["reply"]
    assert status == 400 and openai_error(status, body)["param"] == "messages"  # longer than the context
    assert answered >= 5, answered  # a blocked event loop answers once, after the request


@pytest.mark.parametrize("doc,field", [
    ({"apiVersion": "specd.dev/v1alpha1", "kind": [], "metadata": {"name": "x"}, "spec": {}}, "items[0].kind"),
    ({"apiVersion": "specd.dev/v1alpha1", "kind": {}, "metadata": {"name": "x"}, "spec": {}}, "items[0].kind"),
    ({"apiVersion": "specd.dev/v1alpha1", "kind": "Topology", "metadata": {"name": "rack\n"},
      "spec": {"backend": "ring", "hosts": [{"name": "a", "address": "127.0.0.1"}]}}, "items[0].metadata.name"),
    ({"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": "Upper_Case"},
      "spec": {"source": "x"}}, "items[0].metadata.name"),
    ({"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": "a" * 64},
      "spec": {"source": "x"}}, "items[0].metadata.name"),
    ({"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": "tilde"},
      "spec": {"source": "~nosuchuser-specd/model"}}, "items[0].spec.source"),
])
def test_invalid_admin_applies_are_422_with_the_field_and_store_nothing(daemon, doc, field):
    before = daemon.get(ADMIN + "/models")[1], daemon.get(ADMIN + "/topologies")[1]
    status, raw, _ = post(daemon.url + ADMIN + "/apply", json.dumps({"items": [doc]}).encode())
    body = k8s_status(status, json.loads(raw))
    assert status == 422 and body["details"]["causes"][0]["field"] == field, body
    assert (daemon.get(ADMIN + "/models")[1], daemon.get(ADMIN + "/topologies")[1]) == before


def test_admin_bodies_and_tokens_that_are_not_clean_text(daemon, tmp_path):
    status, raw, _ = post(daemon.url + ADMIN + "/apply", b'{"items": ' + b"[" * 100_000)
    assert status == 400 and k8s_status(status, json.loads(raw))
    status, body = put(daemon.url + ADMIN + "/models/tilde", {
        "apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": "tilde"},
        "spec": {"source": "~nosuchuser-specd/model"}})
    assert status == 422 and k8s_status(status, body)
    (tmp_path / "token").write_text("s3cret\n")
    guarded = start_daemon(tmp_path, {}, True, "--admin-token-file", str(tmp_path / "token"))
    try:
        for token in ("Bearer s\u00e9cret", "Bearer \udcff"):
            request = urllib.request.Request(guarded.url + ADMIN + "/models",
                                             headers={"Authorization": token.encode("utf-8", "surrogateescape")
                                                      .decode("latin-1")})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=10)
            assert err.value.code == 401 and json.loads(err.value.read())["kind"] == "Status"
    finally:
        guarded.stop()


def run_apply(daemon, path: Path, *extra: str) -> subprocess.CompletedProcess:
    return specd(daemon, "apply", "-f", str(path), *extra, check=False)


def alias_bomb(anchors: int, references: int) -> str:
    """A SpecPolicy whose mode is a YAML bomb: each anchor, and the mode's last item, refers to the
    one before ``references`` times (8 and 8: 64 aliases, the cap, for 8**8 strings)."""
    items = ["&a0 [" + ", ".join(["lol"] * references) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * references) + "]" for i in range(1, anchors)]
    items.append("[" + ", ".join([f"*a{anchors - 1}"] * references) + "]")
    return ("apiVersion: specd.dev/v1alpha1\nkind: SpecPolicy\nmetadata: {name: bomb}\n"
            "spec:\n  selector: {}\n  mode:\n" + "".join(f"    - {item}\n" for item in items))


ALIAS_BOMB = """apiVersion: specd.dev/v1alpha1
kind: Model
metadata: {name: bomb}
spec:
  a: &a ["x","x","x","x","x","x","x","x","x"]
  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
  d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
  e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
  f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
  g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
  h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
  i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


@pytest.mark.parametrize("name,content,message", [
    ("bomb.yaml", ALIAS_BOMB.encode(), "aliases"),
    ("bomb-within-the-cap.yaml", alias_bomb(8, 8).encode(), "expands to more than 100000 nodes"),
    ("recursive.yaml", b"apiVersion: specd.dev/v1alpha1\nkind: SpecPolicy\nmetadata: {name: r}\n"
                       b"spec: &s {selector: {}, mode: *s}\n", "refers to a node that contains it"),
    ("surrogate.yaml", b'apiVersion: specd.dev/v1alpha1\nkind: SpecPolicy\nmetadata: {name: s}\n'
                       b'spec: {selector: {}, mode: "\\ud800"}\n', "spec.mode: text holds a lone UTF-16 surrogate"),
    ("long-integer.yaml", b"spec: 1" + b"0" * 5000 + b"\n", "invalid YAML"),
    ("latin1.yaml", "kind: Mod\u00e8le\n".encode("latin-1"), "not UTF-8"),
    ("kind.yaml", b"apiVersion: specd.dev/v1alpha1\nkind: [a, b]\nmetadata: {name: x}\nspec: {}\n", "unknown kind"),
    ("deep.yaml", b"spec: " + b"[" * 50_000 + b"]" * 50_000 + b"\n", "nested too deeply"),
])
def test_apply_f_refuses_hostile_files_with_a_clear_error(daemon, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    proc = run_apply(daemon, path)  # a hang would exceed the CLI runner's timeout
    assert proc.returncode != 0 and message in proc.stderr and name in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_file_in_the_watched_directory_never_stops_the_others(forged, tmp_path):
    d = start_daemon(tmp_path, {"good.yaml": model_manifest("tiny", forged / "target")})
    try:
        manifests = tmp_path / "manifests"
        (manifests / "bad-kind.yaml").write_bytes(b"apiVersion: specd.dev/v1alpha1\nkind: []\nmetadata: {name: x}\n"
                                                  b"spec: {}\n")
        (manifests / "bomb.yaml").write_text(ALIAS_BOMB)
        (manifests / "latin1.yaml").write_bytes("x: \u00e8\n".encode("latin-1"))
        time.sleep(0.5)
        (manifests / "later.yaml").write_text(
            "apiVersion: specd.dev/v1alpha1\nkind: SpecPolicy\nmetadata: {name: later}\n"
            "spec: {selector: {matchLabels: {app: none}}, maxSpeculativeTokens: 2}\n")
        wait_for(lambda: d.get(ADMIN + "/specpolicies/later")[0] == 200, what="the later file applied")
        assert d.get("/readyz")[0] == 200
        events = json.loads(d.get(f"{ADMIN}/models/x/events")[1])  # nothing was stored for the bad ones
        assert events == {"items": []} and d.get(ADMIN + "/models/x")[0] == 404
    finally:
        d.stop()


# -- API keys and CORS ---------------------------------------------------------------


def test_api_keys_guard_the_inference_routes_and_cors_lets_browsers_in(forged, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nsk-first-key\nsk-second-key\n")
    d = start_daemon(tmp_path, {"m.yaml": model_manifest("tiny", forged / "target")}, True,
                     "--api-key-file", str(keys), "--cors-origin", "http://app.example")
    try:
        for key in (None, "wrong", "sk-first-keyX", "sk-\u00e9"):
            headers = {} if key is None else {"Authorization": "Bearer " + key.encode().decode("latin-1")}
            status, body, _ = post(d.url + "/v1/chat/completions", json.dumps(chat_body()).encode(), headers)
            assert status == 401 and openai_error(status, body)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=d.url + "/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=d.url + "/v1", api_key="sk-second-key", max_retries=0)
        assert good.chat.completions.create(**chat_body()).choices[0].message.content is not None
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=d.url, api_key="nope", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        reply = anthropic.Anthropic(base_url=d.url, api_key="sk-first-key", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.type == "message"
        assert d.get("/healthz")[0] == 200 and d.get("/metrics")[0] == 200  # not inference routes
        preflight = urllib.request.Request(d.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        with urllib.request.urlopen(preflight, timeout=10) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "http://app.example"
            assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
        status, body, headers = post(d.url + "/v1/chat/completions", json.dumps(chat_body(stream=True)).encode(),
                                     {"Authorization": "Bearer sk-first-key", "Origin": "http://app.example"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://app.example"
        _, _, headers = post(d.url + "/v1/chat/completions", json.dumps(chat_body()).encode(),
                             {"Authorization": "Bearer sk-first-key", "Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in headers
        assert "sk-first-key" not in d.log() and "sk-second-key" not in d.log()
    finally:
        d.stop()


# -- the fuzz suite ------------------------------------------------------------------

def text(max_size: int) -> st.SearchStrategy[str]:
    """Text from the whole of Unicode: every category, and half the time lone surrogates
    (category Cs, which ``st.text`` leaves out even when its alphabet names them)."""
    with_surrogates = st.lists(st.characters() | st.characters(categories=["Cs"]), max_size=max_size)
    return st.text(st.characters(), max_size=max_size) | with_surrogates.map("".join)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | text(20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text(8), inner, max_size=4),
    max_leaves=12)
CHAT_FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop", "seed",
               "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "response_format", "tools",
               "tool_choice", "speculation", "chat_template_kwargs", "stream_options", "user", "nonsense"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot", 3]),
                                 "content": JSON_VALUES | text(40)})
# every mutation keeps generation short: a fuzz case is about the parser, not decoding at length
SHORT = {"max_tokens": 2, "n": 1}


@st.composite
def chat_bodies(draw) -> dict:
    body = chat_body()
    for key in draw(st.lists(st.sampled_from(CHAT_FIELDS), max_size=4, unique=True)):
        body[key] = draw(st.lists(MESSAGE, max_size=3) if key == "messages" else JSON_VALUES)
    for key, ceiling in SHORT.items():
        if isinstance(body.get(key), int) and body[key] > ceiling:
            body[key] = ceiling
    if not isinstance(body.get("max_tokens"), int):  # null means the whole context: bound it another way
        body["max_completion_tokens"] = SHORT["max_tokens"]
    return body


def holds_lone_surrogate(value) -> bool:
    return lone_surrogate_path(value) is not None


def send_fuzzed(url: str, body) -> tuple[int, bytes]:
    """POST a fuzzed JSON body (lone surrogates as JSON escapes); one with a lone surrogate must be
    a 400. What the daemon sees is the body as JSON decodes it: two escapes that form a UTF-16
    pair (``\\ud800\\udc00``) are one character then, not two lone surrogates."""
    sent = json.dumps(body)
    status, raw, _ = post(url, sent.encode())
    if holds_lone_surrogate(json.loads(sent)):
        HOSTILE["bodies holding a lone surrogate"] += 1
        assert status == 400 and b"surrogate" in raw, (status, raw[:300])
    return status, raw


def check_openai_reply(status: int, raw: bytes, stream: bool) -> None:
    assert status < 500, (status, raw[:300])
    if status >= 400:
        openai_error(status, raw)
    elif not stream:
        json.loads(raw)
    else:
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]


@FUZZ
@given(body=chat_bodies())
def test_fuzzed_chat_bodies_never_5xx(daemon, body):
    status, raw = send_fuzzed(daemon.url + "/v1/chat/completions", body)
    check_openai_reply(status, raw, body.get("stream") is True and status == 200)


@FUZZ
@given(prompt=JSON_VALUES | text(60), extra=st.dictionaries(
    st.sampled_from(["logprobs", "echo", "suffix", "best_of", "temperature", "stop", "stream", "logit_bias"]),
    JSON_VALUES, max_size=3))
def test_fuzzed_completion_bodies_never_5xx(daemon, prompt, extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}
    status, raw = send_fuzzed(daemon.url + "/v1/completions", body)
    check_openai_reply(status, raw, body.get("stream") is True and status == 200)


@FUZZ
@given(raw=st.binary(max_size=200) | text(200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_fuzzed_raw_bytes_never_5xx(daemon, raw):
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings"):
        status, body, _ = post(daemon.url + route, raw)
        assert 400 <= status < 500, (route, status, body[:200])


@FUZZ
@given(body=st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": st.integers(-1, 3)}, optional={
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "x"]),
                                                "content": JSON_VALUES}), max_size=3),
    "system": JSON_VALUES, "tools": JSON_VALUES, "tool_choice": JSON_VALUES, "thinking": JSON_VALUES,
    "output_config": JSON_VALUES | st.fixed_dictionaries({}, optional={"effort": JSON_VALUES}),
    "context_management": JSON_VALUES | st.fixed_dictionaries({}, optional={"edits": JSON_VALUES}),
    "stop_sequences": JSON_VALUES, "stream": JSON_VALUES, "temperature": JSON_VALUES, "junk": JSON_VALUES}))
def test_fuzzed_anthropic_bodies_never_5xx(daemon, body):
    status, raw = send_fuzzed(daemon.url + "/v1/messages", body)
    assert status < 500, (status, raw[:300])
    if status >= 400:
        assert json.loads(raw)["type"] == "error"


@FUZZ
@given(body=st.fixed_dictionaries({"model": st.just("tiny"), "max_output_tokens": st.integers(-1, 3)}, optional={
    "input": JSON_VALUES | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
         "role": st.sampled_from(["user", "assistant", "developer", "x"])},
        optional={"content": JSON_VALUES, "call_id": JSON_VALUES, "name": JSON_VALUES, "arguments": JSON_VALUES,
                  "output": JSON_VALUES, "encrypted_content": JSON_VALUES}), max_size=3),
    "instructions": JSON_VALUES, "tools": JSON_VALUES, "tool_choice": JSON_VALUES, "text": JSON_VALUES,
    "reasoning": JSON_VALUES | st.fixed_dictionaries({}, optional={"effort": JSON_VALUES, "summary": JSON_VALUES}),
    "include": JSON_VALUES | st.lists(JSON_VALUES, max_size=2), "store": JSON_VALUES,
    "previous_response_id": JSON_VALUES,
    "stream": JSON_VALUES, "temperature": JSON_VALUES, "junk": JSON_VALUES}))
def test_fuzzed_responses_bodies_never_5xx(daemon, body):
    status, raw = send_fuzzed(daemon.url + "/v1/responses", body)
    assert status < 500, (status, raw[:300])
    if status >= 400:
        assert "error" in json.loads(raw)


@FUZZ
@given(body=st.fixed_dictionaries({"model": st.sampled_from(["tiny", "nope"]) | JSON_VALUES}, optional={
    "input": JSON_VALUES | st.lists(text(20) | st.lists(st.integers(-3, 2000), max_size=4), max_size=3),
    "encoding_format": JSON_VALUES, "dimensions": JSON_VALUES, "user": JSON_VALUES, "junk": JSON_VALUES}))
def test_fuzzed_embeddings_bodies_never_5xx(daemon, body):
    """``tiny`` generates: every body that parses is refused for its model (a 400 naming it)."""
    status, raw = send_fuzzed(daemon.url + "/v1/embeddings", body)
    assert 400 <= status < 500, (status, raw[:300])
    assert "error" in json.loads(raw)


MANIFESTS = st.fixed_dictionaries({
    "apiVersion": st.sampled_from(["specd.dev/v1alpha1", "v1", 1]),
    "kind": st.sampled_from(["Model", "DraftPairing", "SpecPolicy", "Topology", "Secret"]) | JSON_VALUES,
    "metadata": st.fixed_dictionaries({"name": st.from_regex(r"fz-[a-z0-9-]{0,8}", fullmatch=True) | JSON_VALUES},
                                      optional={"labels": JSON_VALUES}) | JSON_VALUES,
    "spec": st.dictionaries(st.sampled_from(["source", "targetRef", "method", "selector", "backend", "hosts",
                                             "maxBatchSize", "prefixCache", "kvCache", "numSpeculativeTokens", "x"]),
                            JSON_VALUES, max_size=4) | JSON_VALUES})


@st.composite
def manifest_files(draw) -> bytes:
    """Fuzzed manifests as a YAML file with anchors and aliases: values shared between places
    (PyYAML writes each as an anchor and aliases), now and then a bomb of aliases of aliases or
    a value that contains itself; then junk bytes."""
    docs = draw(st.lists(MANIFESTS, min_size=1, max_size=2))
    shared = draw(st.lists(JSON_VALUES, min_size=1, max_size=3))
    shape = draw(st.sampled_from(["plain", "shared", "bomb", "recursive"]))
    if shape == "bomb":
        for _ in range(draw(st.integers(1, 8))):
            shared = [shared] * draw(st.integers(1, 8))
    elif shape == "recursive":
        shared.append(shared)
    if shape != "plain":  # in two to four places, so that it is written once and aliased
        places = st.sampled_from(["source", "mode", "selector", "hosts", "x"])
        for key in draw(st.lists(places, min_size=2, max_size=4, unique=True)):
            doc = docs[draw(st.integers(0, len(docs) - 1))]
            (doc["spec"] if isinstance(doc["spec"], dict) else doc)[key] = shared
    raw = yaml.safe_dump_all(docs).encode() + draw(st.binary(max_size=60))
    HOSTILE["manifest files with aliases"] += b"*id" in raw
    HOSTILE["manifest files holding a lone surrogate"] += holds_lone_surrogate(docs)
    HOSTILE[f"manifest files shaped {shape}"] += 1
    return raw


def stored(daemon) -> list:
    """Every stored object's kind, name and version (status, which the reconciler updates, left out)."""
    return sorted((o["kind"], o["metadata"]["name"], o["metadata"]["resourceVersion"])
                  for plural in ("models", "draftpairings", "specpolicies", "topologies")
                  for o in json.loads(daemon.get(f"{ADMIN}/{plural}")[1])["items"])


@FUZZ
@given(docs=st.lists(MANIFESTS, min_size=1, max_size=3))
def test_fuzzed_admin_applies_answer_a_status_and_store_nothing_refused(daemon, docs):
    before = stored(daemon)
    status, raw = send_fuzzed(daemon.url + ADMIN + "/apply?dryRun=All", {"items": docs})
    if status != 200:
        k8s_status(status, json.loads(raw))
    assert stored(daemon) == before  # a dry run, or a refusal, stores nothing


@settings(max_examples=15, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(raw=manifest_files())
def test_fuzzed_manifest_files_through_apply_f(daemon, tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("fuzz") / "m.yaml"
    path.write_bytes(raw)
    before = stored(daemon)
    proc = run_apply(daemon, path, "--dry-run", "server")  # the daemon's own models stay as they are
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0 or proc.stderr.strip()
    if b"\\uD" in raw:  # PyYAML writes lone surrogates (and only those, here) as \uDxxx escapes
        assert proc.returncode != 0, proc.stdout
    assert stored(daemon) == before and daemon.get("/readyz")[0] == 200


@pytest.fixture(scope="module")
def watched(forged, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("watched")
    d = start_daemon(tmp, {"good.yaml": model_manifest("tiny", forged / "target")})
    yield d, tmp / "manifests"
    d.stop()


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(raw=manifest_files())
def test_fuzzed_files_in_the_watched_directory_never_stop_it(watched, raw):
    """Each fuzzed file lands beside the good one; afterwards a new good file still applies."""
    d, directory = watched
    (directory / "fuzz.yaml").write_bytes(raw)
    time.sleep(0.3)  # the watcher's debounce
    assert d.get("/healthz")[0] == 200


def test_the_watched_directory_applies_after_the_fuzzing(watched):
    d, directory = watched
    (directory / "fuzz.yaml").unlink(missing_ok=True)
    (directory / "after.yaml").write_text("apiVersion: specd.dev/v1alpha1\nkind: SpecPolicy\nmetadata: {name: after}\n"
                                          "spec: {selector: {matchLabels: {app: none}}, maxSpeculativeTokens: 2}\n")
    wait_for(lambda: d.get(ADMIN + "/specpolicies/after")[0] == 200, what="the file after the fuzzing applied")
    assert d.get(ADMIN + "/models/tiny")[0] == 200
    assert "unhandled error" not in d.log() and "applying a manifest file failed" not in d.log()


def test_the_daemon_still_serves_after_the_fuzzing(daemon, client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert daemon.get("/readyz")[0] == 200 and "unhandled error" not in daemon.log()
    print("\nbodies sent by route and status:", dict(sorted(TALLY.items())))
    print("hostile inputs among them:", dict(sorted(HOSTILE.items())))
