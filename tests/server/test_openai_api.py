"""The OpenAI-compatible surface, through the official client, against a real daemon."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import urllib.request

from daemons import scrape

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(",
    "# Parse the arguments\nparser = argparse.",
    "with open(path) as f:\n",
    "try:\n    import json\nexcept ImportError:\n",
    "x = {'a': 1, 'b': [1, 2, 3]}\n",
]


def greedy(client, prompt: str, max_tokens: int = 48, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kw)


def metric(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)


def test_models_list(client):
    models = client.models.list()
    assert sorted(m.id for m in models.data) == ["tiny", "tiny-spec"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion_non_streaming_usage_and_length(client, tokenizer):
    r = greedy(client, PROMPTS[0], max_tokens=12, logprobs=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0], add_special_tokens=False))
    assert r.usage.completion_tokens == 12 == len(choice.logprobs.token_logprobs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert choice.text == "".join(choice.logprobs.tokens)


def test_completion_streaming_matches_non_streaming(client):
    full = greedy(client, PROMPTS[1], max_tokens=20)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20


def test_chat_non_streaming_and_streaming(client, tokenizer):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                       logprobs=True, top_logprobs=3)
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.choices[0].message.role == "assistant"
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens
    assert all(len(lp.top_logprobs) == 3 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-5 for lp in lps)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_stop_string_spanning_tokens(client):
    free = greedy(client, PROMPTS[2], max_tokens=40, logprobs=0)
    tokens = free.choices[0].logprobs.tokens
    # A stop string made of the tail of one token and the head of the next.
    i = next(i for i in range(3, len(tokens) - 1) if len(tokens[i]) >= 2 and tokens[i + 1])
    prefix = "".join(tokens[:i])
    stop = tokens[i][-1] + tokens[i + 1][:2]
    cut = free.choices[0].text.find(stop)
    assert cut >= 0
    r = greedy(client, PROMPTS[2], max_tokens=40, stop=[stop, "never-appears"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free.choices[0].text[:cut]
    assert len(prefix) >= cut or stop not in r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == free.choices[0].text[:cut]


def test_concurrent_greedy_equals_solo(client):
    solo = [greedy(client, p, max_tokens=64).choices[0].text for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: greedy(client, p, max_tokens=64).choices[0].text, PROMPTS))
    assert batched == solo
    assert len(set(solo)) > 1


def test_seeded_sampling_is_reproducible_alone_and_batched(client):
    kw = dict(model="tiny", prompt=PROMPTS[3], max_tokens=32, temperature=0.9, top_p=0.95, seed=1234)
    alone = client.completions.create(**kw).choices[0].text
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, **kw)]
        futures += [pool.submit(greedy, client, p) for p in PROMPTS[4:7]]
        assert futures[0].result().choices[0].text == alone


def test_disconnected_stream_frees_its_slot(client, daemon):
    before = scrape(daemon)
    stream = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=1500, temperature=0,
                                       stream=True)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = scrape(daemon)
        if metric(after, "specd_request_success_total", finished_reason="abort") > \
                metric(before, "specd_request_success_total", finished_reason="abort"):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the disconnected request was never aborted")
    assert metric(after, "specd_num_requests_running") == 0
    generated = metric(after, "specd_generation_tokens_total") - metric(before, "specd_generation_tokens_total")
    assert generated < 1500


@pytest.mark.parametrize("body,status,param", [
    ({"model": "tiny", "prompt": "x", "temperature": 7}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": 5}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "stop": [1, 2]}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": [5] * 5000}, 400, "prompt"),
    ({"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [5, -1]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {str(10**9): 1}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "echo": True}, 400, "echo"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
])
def test_bad_completion_requests(daemon, body, status, param):
    code, payload = post(daemon, "/v1/completions", json.dumps(body).encode())
    assert code == status
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", "\"\xff\"".encode("latin-1")])
def test_malformed_bodies(daemon, raw):
    code, payload = post(daemon, "/v1/chat/completions", raw)
    assert code == 400
    assert json.loads(payload)["error"]["type"] == "invalid_request_error"


def test_client_sees_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])


def post(daemon, path: str, data: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(daemon.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_metrics_parse_and_move_with_traffic(client, daemon):
    before = scrape(daemon)
    greedy(client, PROMPTS[5], max_tokens=10)
    after = scrape(daemon)
    assert metric(after, "specd_request_success_total", finished_reason="length") == \
        metric(before, "specd_request_success_total", finished_reason="length") + 1
    assert metric(after, "specd_generation_tokens_total") == metric(before, "specd_generation_tokens_total") + 10
    assert metric(after, "specd_prompt_tokens_total") > metric(before, "specd_prompt_tokens_total")
    for hist in ("specd_time_to_first_token_seconds", "specd_e2e_request_latency_seconds",
                 "specd_request_queue_time_seconds", "specd_inter_token_latency_seconds"):
        assert metric(after, hist + "_count") > metric(before, hist + "_count"), hist
    assert ("specd_num_requests_waiting", (("model_name", "tiny"),)) in after


def test_http_requests_counted_by_route_and_status(client, daemon):
    before = scrape(daemon)
    client.models.list()
    assert post(daemon, "/v1/chat/completion", b"{}")[0] == 404  # a typo in the route
    assert post(daemon, "/v1/chat/completions", b"{not json")[0] == 400
    after = scrape(daemon)

    def moved(handler: str, status: str, method: str = "POST") -> float:
        key = ("http_requests_total", tuple(sorted({"method": method, "handler": handler, "status": status}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert moved("/v1/models", "200", "GET") == 1
    assert moved("none", "404") == 1  # no route matched: counted apart, not under the path it asked for
    assert moved("/v1/chat/completions", "400") == 1
    assert after[("http_request_duration_seconds_count", (("handler", "/v1/models"), ("method", "GET")))] >= 1


def test_speculation_per_request_and_by_pairing(client, daemon):
    before = scrape(daemon)
    plain = greedy(client, PROMPTS[6], max_tokens=64)
    assert getattr(plain.usage, "speculation", None) is None
    ngram = greedy(client, PROMPTS[6], max_tokens=64,
                   extra_body={"speculation": {"method": "ngram", "num_speculative_tokens": 4}})
    paired = client.completions.create(model="tiny-spec", prompt=PROMPTS[6], max_tokens=64, temperature=0)
    assert ngram.choices[0].text == plain.choices[0].text == paired.choices[0].text
    assert ngram.usage.speculation["method"] == "ngram"
    stats = paired.usage.speculation
    assert stats["method"] == "draft" and stats["draft_tokens"] > 0
    assert stats["acceptance_rate"] == round(stats["accepted_tokens"] / stats["draft_tokens"], 4)
    off = client.completions.create(model="tiny-spec", prompt=PROMPTS[6], max_tokens=64, temperature=0,
                                    extra_body={"speculation": {"method": "none"}})
    report = off.usage.speculation  # the request set speculation, so its usage reports it, "none" too
    assert (report["method"], report["source"], report["rounds"]) == ("none", "request", 0)
    after = scrape(daemon)
    # the pairing's rows also propose n-gram lookups where the context repeats: counted under ngram,
    # in the request's usage as in the metrics
    by_method = stats["by_method"]
    assert set(by_method) <= {"draft", "ngram"} and by_method["draft"]["draft_tokens"] > 0
    for field in ("rounds", "draft_tokens", "accepted_tokens"):
        assert sum(m[field] for m in by_method.values()) == stats[field]
    for method in ("draft", "ngram"):
        for field, name in (("draft_tokens", "specd_spec_decode_num_draft_tokens_total"),
                            ("accepted_tokens", "specd_spec_decode_num_accepted_tokens_total"),
                            ("rounds", "specd_spec_decode_num_drafts_total")):
            series = (name, (("method", method), ("model_name", "tiny-spec")))
            assert after.get(series, 0) - before.get(series, 0) == by_method.get(method, {}).get(field, 0)
    assert any(n == "specd_spec_decode_num_accepted_tokens_per_pos_total" for n, _ in after)
    assert any(n == "specd_spec_decode_verify_seconds_count" for n, _ in after)


@pytest.mark.parametrize("spec,param", [
    ({"method": "eagle-9"}, "speculation.method"),
    ({"method": "draft"}, "speculation.method"),  # tiny has no draft model
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculation.num_speculative_tokens"),
    ({"method": "ngram", "k": 3}, "speculation.k"),
])
def test_bad_speculation_requests(daemon, spec, param):
    body = {"model": "tiny", "prompt": "x", "speculation": spec}
    code, payload = post(daemon, "/v1/completions", json.dumps(body).encode())
    assert code == 400
    assert json.loads(payload)["error"]["param"] == param
