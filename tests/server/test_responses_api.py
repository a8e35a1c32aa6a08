"""OpenAI's Responses API through the official ``openai`` client (``responses.create``
and ``responses.stream``), against a daemon serving forged chat models: the same
engine path as chat, its items, its stream events, stored responses and their
continuation."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from test_tools import SCHEMAS, TOOLS, WEATHER

RESPONSE_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                   "parameters": t["function"]["parameters"]} for t in TOOLS]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(chat_daemon):
    return openai.OpenAI(base_url=chat_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def streamed_events(client, kwargs: dict) -> list:
    """Every event of ``responses.stream``; the last one holds the final response
    (``response.incomplete`` when ``max_output_tokens`` ended it, which the
    SDK's ``get_final_response`` does not take)."""
    with client.responses.stream(**kwargs) as stream:
        return list(stream)


def rendered(tokenizer, messages: list[dict], tools=None) -> list[int]:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)


def test_a_response_and_its_stream_agree(client, chat_models):
    """Greedy: reasoning then text, the same whole and streamed; usage counts the rendered prompt."""
    kwargs = dict(model="hermes", input=QUESTION, instructions="Be brief.", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert [item.type for item in whole.output][:1] == ["reasoning"] and whole.output[-1].type == "message"
    events = streamed_events(client, kwargs)
    streamed = events[-1].response
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert "response.reasoning_text.delta" in kinds
    assert ("response.output_text.delta" in kinds) == bool(whole.output_text)
    assert [item.type for item in streamed.output] == [item.type for item in whole.output]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert streamed.output_text == whole.output_text
    assert streamed.output[0].content[0].text == whole.output[0].content[0].text
    prompt = rendered(load_tokenizer(chat_models["hermes"]),
                      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert whole.usage.input_tokens == len(prompt) and whole.usage.output_tokens <= 24


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_function_calls_validate_whole_and_streamed(client, choice):
    kwargs = dict(model="hermes", input=QUESTION, tools=RESPONSE_TOOLS, tool_choice=choice, max_output_tokens=160,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    streamed = streamed_events(client, kwargs)[-1].response
    for response in (whole, streamed):
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls
        for call in calls:
            assert call.call_id and (choice == "required" or call.name == "get_weather")
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert [c.arguments for c in whole.output if c.type == "function_call"] == [
        c.arguments for c in streamed.output if c.type == "function_call"]


NAMESPACED = [{"type": "namespace", "name": "forecast", "description": "Weather tools.", "tools": RESPONSE_TOOLS}]


def test_namespaced_tools_are_called_by_name_and_namespace_and_come_back_into_the_prompt(client, chat_models):
    """Codex's ``namespace`` tools: the template sees ``forecast.get_weather``; a call
    names its function and its namespace, whole and streamed, and goes back as such."""
    kwargs = dict(model="hermes", input=QUESTION, tools=NAMESPACED, max_output_tokens=160, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather", "namespace": "forecast"})
    whole = client.responses.create(**kwargs)
    streamed = streamed_events(client, kwargs)[-1].response
    for response in (whole, streamed):
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and all((c.name, c.namespace) == ("get_weather", "forecast") for c in calls)
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    call = next(item for item in whole.output if item.type == "function_call")
    again = client.responses.create(model="hermes", tools=NAMESPACED, max_output_tokens=2, temperature=0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "namespace": call.namespace,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    tokenizer = load_tokenizer(chat_models["hermes"])
    qualified = [{"type": "function", "function": {**t["function"], "name": f"forecast.{t['function']['name']}",
                                                   "description": f"Weather tools. {t['function']['description']}"}}
                 for t in TOOLS]
    prompt = rendered(tokenizer, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "forecast.get_weather", "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": "forecast.get_weather", "content": "sunny"}], qualified)
    assert again.usage.input_tokens == len(prompt)


def test_hosted_tools_are_left_out_only_when_the_daemon_says_so():
    from specd.server.chat import parse_tools
    from specd.server.errors import APIError

    tools = [{"type": "web_search", "external_web_access": False}, RESPONSE_TOOLS[0]]
    assert [t.name for t in parse_tools(tools, flat=True, drop_hosted=True)] == [RESPONSE_TOOLS[0]["name"]]
    with pytest.raises(APIError) as err:
        parse_tools(tools, flat=True)
    assert err.value.param == "tools[0].type"
    with pytest.raises(APIError) as err:  # a client-run tool of another kind is still refused by name
        parse_tools([{"type": "custom", "name": "apply_patch"}], flat=True, drop_hosted=True)
    assert err.value.param == "tools[0].type"


def test_function_call_output_reaches_the_prompt(client, chat_models):
    def turn(result: str):
        return client.responses.create(model="hermes", tools=RESPONSE_TOOLS, max_output_tokens=4, temperature=0,
                                       input=[{"role": "user", "content": QUESTION},
                                              {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                               "arguments": json.dumps({"city": "Paris", "days": 2})},
                                              {"type": "function_call_output", "call_id": "call_1",
                                               "output": result}])
    tokenizer = load_tokenizer(chat_models["hermes"])
    prompt = rendered(tokenizer, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 24 degrees"}], TOOLS)
    assert "sunny, 24 degrees" in tokenizer.decode(prompt)
    assert turn("sunny, 24 degrees").usage.input_tokens == len(prompt)
    assert turn("rain all week, 9 degrees").usage.input_tokens != len(prompt)


def test_text_format_json_schema_is_enforced(client):
    """On a model whose template does not open a think block (a grammar holds from the first token)."""
    for temperature in (0, 1.0):
        response = client.responses.create(model="llama3", input=QUESTION, max_output_tokens=96,
                                           temperature=temperature, text={"format": {
                                               "type": "json_schema", "name": "weather", "schema": WEATHER,
                                               "strict": True}})
        jsonschema.validate(json.loads(response.output_text), WEATHER)


def test_stored_responses_continue_and_can_be_read_and_deleted(client, chat_models):
    """``previous_response_id`` renders the stored conversation again (the
    prefix cache finds it: cached tokens), retrieve and input_items read it
    back, delete removes it; ``store: false`` keeps nothing."""
    first = client.responses.create(model="hermes", input=QUESTION * 8, max_output_tokens=8, temperature=0)
    second = client.responses.create(model="hermes", previous_response_id=first.id, input="And in Rome?",
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(second.id).data
    assert len(items) == 1 + len(first.output) + 1
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="hermes", previous_response_id=first.id, input="Again?", max_output_tokens=2)
    unstored = client.responses.create(model="hermes", input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_encrypted_reasoning_comes_back_into_the_prompt(client):
    """With ``store: false`` a client keeps the reasoning itself: asked with
    ``include``, it comes back sealed, and sent back it is rendered again."""
    first = client.responses.create(model="hermes", input=QUESTION, max_output_tokens=16, temperature=0,
                                    store=False, include=["reasoning.encrypted_content"])
    reasoning = next(item for item in first.output if item.type == "reasoning")
    assert reasoning.encrypted_content
    sealed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    history = [{"role": "user", "content": QUESTION},
               *[sealed if item.type == "reasoning" else item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "Thanks."}]
    with_reasoning = client.responses.create(model="hermes", input=history, max_output_tokens=2, store=False)
    without = client.responses.create(model="hermes", input=[i for i in history if i.get("type") != "reasoning"],
                                      max_output_tokens=2, store=False)
    assert with_reasoning.usage.input_tokens > without.usage.input_tokens


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"include": [[]]}, "include[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "frob"}}}}, "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"metadata": [1]}, "metadata"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"effort": {"level": "high"}}}, "reasoning.effort"),
    ({"truncation": "auto"}, "truncation"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}]}, "input"),
    ({"tools": [{"type": "namespace", "name": "a.b", "tools": []}]}, "tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "a.b"}]}]},
     "tools[0].tools[0].name"),
])
def test_what_specd_cannot_do_is_refused_by_name(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="hermes", max_output_tokens=2, input=QUESTION, extra_body=body)
    assert err.value.body["param"] == param
