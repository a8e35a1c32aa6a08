"""Tools, structured output and reasoning through the official ``openai``
client: forced calls in every family format validate against the tool's
schema, ``json_schema`` output always validates, tool results reach the
prompt, and reasoning is split from content."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from specd.forge.chat import STYLES
from specd.server.chat import HarmonySplitter, OutputSplitter, Tool

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                    "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def chat_client(chat_daemon):
    return openai.OpenAI(base_url=chat_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(chat_daemon):
    return anthropic.Anthropic(base_url=chat_daemon.url, api_key="unused", max_retries=0, timeout=60)


def check_calls(calls, names=None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list, str]:
    """Tool calls reassembled from deltas (by index, arguments concatenated), and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_named_tool_choice_always_yields_a_valid_call(chat_client, style):
    """In the family's own format, greedy and sampled, streamed and not."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        kwargs = dict(model=style, messages=USER, tools=TOOLS, tool_choice=named, max_tokens=64,
                      temperature=temperature, seed=seed)
        out = chat_client.chat.completions.create(**kwargs)
        assert out.choices[0].finish_reason == "tool_calls"
        check_calls(out.choices[0].message.tool_calls, {"get_weather"})
        calls, finish = streamed_calls(chat_client.chat.completions.create(stream=True, **kwargs))
        assert finish == "tool_calls"
        check_calls(calls, {"get_weather"})
        if seed is not None:  # a seeded request streams what it returns whole
            assert [c.function.arguments for c in calls] == [
                c.function.arguments for c in out.choices[0].message.tool_calls]


@pytest.mark.parametrize("model,speculation", [("hermes", None), ("hermes", "ngram"), ("hermes-spec", None)])
def test_required_tool_choice_calls_one_of_the_tools(chat_client, model, speculation):
    """``required`` with parallel calls allowed (each validates) and not (exactly one), with speculation on and off."""
    extra = {"speculation": {"method": speculation}} if speculation else {}
    for seed in range(4):
        out = chat_client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                                  max_tokens=160, temperature=1.0, seed=seed, extra_body=extra)
        check_calls(out.choices[0].message.tool_calls, set(SCHEMAS))
        one = chat_client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=160, temperature=1.0,
                                                  seed=seed, extra_body=extra)
        assert len(one.choices[0].message.tool_calls) == 1
        check_calls(one.choices[0].message.tool_calls, set(SCHEMAS))


@pytest.mark.parametrize("style", sorted(STYLES))
def test_tool_calls_and_results_in_the_history_reach_the_prompt(chat_client, chat_models, style):
    """The assistant's call and the tool's result are rendered by the model's template."""
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 24 degrees"}]
    out = chat_client.chat.completions.create(model=style, messages=history, tools=TOOLS, max_tokens=4,
                                              temperature=0)
    tokenizer = load_tokenizer(chat_models[style])
    expected = history[:1] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 24 degrees"}]
    prompt = tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True)
    text = tokenizer.decode(prompt)
    assert "sunny, 24 degrees" in text and "Paris" in text and "get_weather" in text
    assert out.usage.prompt_tokens == len(prompt)
    other = history[:2] + [{**history[2], "content": "rain all week, 9 degrees"}]
    changed = chat_client.chat.completions.create(model=style, messages=other, tools=TOOLS, max_tokens=4,
                                                  temperature=0)
    assert changed.usage.prompt_tokens != out.usage.prompt_tokens


@pytest.mark.parametrize("model,speculation", [("tiny", None), ("tiny", "ngram"), ("tiny-spec", None)])
def test_json_schema_output_always_validates(client, tokenizer, model, speculation):
    """Greedy and sampled (three choices each), with speculation on and off;
    compact; and any object for json_object (a random model's strings end
    only by chance, so quotes and braces are favoured to end them soon)."""
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    extra = {"speculation": {"method": speculation}} if speculation else {}
    for temperature in (0, 1.0):
        out = client.chat.completions.create(model=model, messages=USER, response_format=response_format,
                                             max_tokens=96, temperature=temperature, seed=5, n=3, extra_body=extra)
        for choice in out.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)
            assert ", " not in choice.message.content.replace('", "', "") and ": " not in choice.message.content
    ends = {str(tokenizer.encode(c)[0]): 6 for c in '"}'}
    out = client.chat.completions.create(model=model, messages=USER, response_format={"type": "json_object"},
                                         max_tokens=200, temperature=0, logit_bias=ends, extra_body=extra)
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_json_schema_streams_and_serves_text_completions(client):
    stream = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=96, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), PERSON)
    text = client.completions.create(model="tiny", prompt="person:", max_tokens=96, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": PERSON}}})
    jsonschema.validate(json.loads(text.choices[0].text), PERSON)


def test_reasoning_is_split_from_content_and_template_kwargs_reach_the_template(chat_client):
    """The Hermes template opens a think block unless ``enable_thinking`` is false."""
    out = chat_client.chat.completions.create(model="hermes", messages=USER, max_tokens=16, temperature=0)
    message = out.choices[0].message
    assert message.reasoning_content and message.content == ""
    stream = chat_client.chat.completions.create(model="hermes", messages=USER, max_tokens=16, temperature=0,
                                                 stream=True)
    chunks = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == message.reasoning_content
    off = chat_client.chat.completions.create(model="hermes", messages=USER, max_tokens=16, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and not getattr(off.choices[0].message, "reasoning_content", None)
    assert off.usage.prompt_tokens > out.usage.prompt_tokens  # the template closed the think block


def test_reasoning_sent_back_on_an_assistant_message_reaches_the_template(chat_client, chat_models):
    """OpenCode returns each reply's ``reasoning_content`` with its history (vLLM's newer clients
    send ``reasoning``): the template renders it as the model generated it, so the next request's
    prompt starts with the reply the prefix cache holds."""
    hermes = load_tokenizer(chat_models["hermes"])
    history = [{"role": "user", "content": "Question 1?"},
               {"role": "assistant", "content": "Answer 1.", "reasoning_content": "Pondering number 1."},
               {"role": "user", "content": "Question 2?"}]
    expected = len(hermes.apply_chat_template(history, add_generation_prompt=True))
    without = len(hermes.apply_chat_template([{k: v for k, v in m.items() if k != "reasoning_content"}
                                              for m in history], add_generation_prompt=True))
    assert expected > without, "the template shows the reasoning: the test would not see it dropped"
    for key in ("reasoning_content", "reasoning"):
        messages = [{**m, key: m["reasoning_content"]} if "reasoning_content" in m else m for m in history]
        messages = [{k: v for k, v in m.items() if k != "reasoning_content" or key == k} for m in messages]
        out = chat_client.chat.completions.create(model="hermes", messages=messages, max_tokens=1)
        assert out.usage.prompt_tokens == expected, key
    bad = history[:1] + [{"role": "user", "content": "x", "reasoning_content": "not the model's"}]
    with pytest.raises(openai.BadRequestError) as refused:
        chat_client.chat.completions.create(model="hermes", messages=bad, max_tokens=1)
    assert refused.value.body["param"] == "messages[1].reasoning_content"


@pytest.mark.parametrize("body,param", [
    ({"model": "hermes", "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"model": "hermes", "tool_choice": "required"}, "tool_choice"),
    ({"model": "hermes", "tools": [{"type": "function", "function": {"parameters": WEATHER}}]},
     "tools[0].function.name"),
    ({"model": "hermes", "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"model": "hermes", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"model": "hermes", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"model": "hermes", "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"model": "hermes", "messages": USER + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_and_format_requests_are_refused_by_field(chat_client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        fields = {"messages": USER, **body}
        chat_client.chat.completions.create(model=fields.pop("model"), messages=fields.pop("messages"), max_tokens=4,
                                            extra_body=fields)
    assert err.value.body["param"] == param, err.value.body


def test_tools_for_a_template_that_cannot_render_them_are_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=4)
    assert err.value.body["param"] == "tools" and "does not render tools" in err.value.body["message"]


def feed_in_pieces(splitter, text: str, size: int):
    content, reasoning, calls = "", "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for n, piece in enumerate(pieces):
        delta = splitter.feed(piece, finished=n == len(pieces) - 1)
        content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + delta.tool_calls
    return content, reasoning, [(c.name, c.arguments) for c in calls]


def test_output_splitting_finds_markers_across_chunk_boundaries(chat_models):
    """Think tags and tool calls (Hermes), harmony channels, and Llama 3's bare JSON,
    whatever the chunking, and a call that does not parse stays in the content."""
    hermes = load_tokenizer(chat_models["hermes"])
    tools = [Tool("get_weather", WEATHER)]
    text = ('<think>\nplan it</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"days": 1}}\n</tool_call><tool_call>\nnot json\n</tool_call>')
    for size in (1, 3, len(text)):
        splitter = OutputSplitter(hermes, [], tools, forced=False)
        content, reasoning, calls = feed_in_pieces(splitter, text, size)
        assert reasoning == "\nplan it" and calls == [("get_weather", {"city": "Oslo", "days": 1})]
        assert content == "Checking.\nnot json\n"
    harmony = ('<|channel|>analysis<|message|>think first<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "days": 3}<|call|>'
               '<|start|>assistant<|channel|>final<|message|>Done.')
    for size in (1, 5, len(harmony)):
        content, reasoning, calls = feed_in_pieces(HarmonySplitter(), harmony, size)
        assert (content, reasoning, calls) == ("Done.", "think first", [("get_weather", {"city": "Rome", "days": 3})])
    llama = load_tokenizer(chat_models["llama3"])
    for text, expected in (('{"name": "get_weather", "parameters": {"city": "Ankara", "days": 2}}',
                            ("", "", [("get_weather", {"city": "Ankara", "days": 2})])),
                           ("{not a call", ("{not a call", "", []))):
        assert feed_in_pieces(OutputSplitter(llama, [], tools, forced=False), text, 4) == expected


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.parametrize("style", ["hermes", "harmony"])
def test_anthropic_forced_tool_use_validates(claude, style):
    """tool_choice tool and any, whole and streamed, greedy and sampled."""
    for choice, names in (({"type": "tool", "name": "get_weather"}, {"get_weather"}), ({"type": "any"}, set(SCHEMAS))):
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
            kwargs = dict(model=style, messages=USER, max_tokens=160, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                          extra_body=extra)
            message = claude.messages.create(**kwargs)
            with claude.messages.stream(**kwargs) as stream:
                streamed = stream.get_final_message()
            for out in (message, streamed):
                uses = [b for b in out.content if b.type == "tool_use"]
                assert out.stop_reason == "tool_use" and uses
                for use in uses:
                    assert use.name in names and use.id.startswith("toolu_")
                    jsonschema.validate(use.input, SCHEMAS[use.name])
    single = claude.messages.create(model=style, messages=USER, max_tokens=160, tools=ANTHROPIC_TOOLS,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert len([b for b in single.content if b.type == "tool_use"]) == 1


def test_anthropic_tool_results_reach_the_prompt(claude, chat_models):
    def conversation(result: str) -> list[dict]:
        return USER + [
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris", "days": 2}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]
    counted = claude.messages.count_tokens(model="hermes", messages=conversation("sunny, 24 degrees"),
                                           tools=ANTHROPIC_TOOLS)
    tokenizer = load_tokenizer(chat_models["hermes"])
    rendered = USER + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "sunny, 24 degrees"}]
    prompt = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True)
    assert "sunny, 24 degrees" in tokenizer.decode(prompt) and counted.input_tokens == len(prompt)
    message = claude.messages.create(model="hermes", messages=conversation("sunny, 24 degrees"), max_tokens=4,
                                     tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)
    other = claude.messages.count_tokens(model="hermes", messages=conversation("rain all week, 9 degrees"),
                                         tools=ANTHROPIC_TOOLS)
    assert other.input_tokens != counted.input_tokens


def test_anthropic_thinking_blocks(claude):
    """The Hermes template thinks by default: a thinking block, then text; ``thinking`` disabled: text only."""
    message = claude.messages.create(model="hermes", messages=USER, max_tokens=16, extra_body={"temperature": 0})
    assert [b.type for b in message.content] == ["thinking", "text"] and message.content[0].thinking
    with claude.messages.stream(model="hermes", messages=USER, max_tokens=16,
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == message.content[0].thinking
    off = claude.messages.create(model="hermes", messages=USER, max_tokens=16, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text


def test_anthropic_thinking_display_omitted_sends_empty_thinking_blocks(claude):
    """Claude Code asks ``thinking: {display: omitted}`` when it will not show thinking: the blocks
    stay (a reply's shape is the same) but hold no thinking, whole or streamed."""
    thinking = {"type": "adaptive", "display": "omitted"}
    message = claude.messages.create(model="hermes", messages=USER, max_tokens=16, thinking=thinking,
                                     extra_body={"temperature": 0})
    assert [b.type for b in message.content] == ["thinking", "text"] and message.content[0].thinking == ""
    with claude.messages.stream(model="hermes", messages=USER, max_tokens=16, thinking=thinking,
                                extra_body={"temperature": 0}) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "thinking" and streamed.content[0].thinking == ""
    assert "thinking_delta" not in deltas
    for bad, param in (({"type": "adaptive", "display": "loud"}, "thinking.display"),
                       ({"type": "adaptive", "colour": "blue"}, "thinking.colour")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model="hermes", messages=USER, max_tokens=4, thinking=bad)
        assert param in str(refused.value)


def test_claude_codes_billing_header_does_not_reach_the_prompt(claude):
    """Claude Code's first system block is a billing line with a fingerprint of the session's first
    message: left out, so sessions share their system prompt and tools (and the prefix cache)."""
    system = [{"type": "text", "text": "You are a coding agent. Be brief."}]
    counted = claude.messages.count_tokens(model="hermes", messages=USER, system=system).input_tokens
    for suffix in ("4a6", "0b8"):
        header = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.{suffix}; "
                                          "cc_entrypoint=sdk-cli;"}
        assert claude.messages.count_tokens(model="hermes", messages=USER,
                                            system=[header, *system]).input_tokens == counted
    as_text = "x-anthropic-billing-header: cc_version=2.1.332.4a6;\nYou are a coding agent. Be brief."
    assert claude.messages.count_tokens(model="hermes", messages=USER, system=as_text).input_tokens == counted


def test_tool_call_arguments_are_strict_json(chat_models):
    """A number past float's range, valid JSON as the model wrote it, is sent as the largest float
    (never ``Infinity``, which clients' JSON parsers reject); a NaN literal as null."""
    from specd.server.chat import HERMES, parse_calls

    hermes = load_tokenizer(chat_models["hermes"])
    calls = parse_calls(HERMES, '{"name": "f", "arguments": {"x": 1e999, "y": [-1e999, NaN], "z": 2}}', hermes)
    text = json.dumps(calls[0].arguments, allow_nan=False)
    assert json.loads(text) == {"x": 1.7976931348623157e308, "y": [-1.7976931348623157e308, None], "z": 2}


def test_anthropic_requests_as_claude_code_sends_them(claude, chat_models):
    """Claude Code's request shapes: ``thinking`` adaptive thinks like enabled,
    ``output_config.effort`` reaches the template as its reasoning effort (max
    as high), a system message inside ``messages`` is rendered where it
    stands, and ``cache_control`` marks change nothing."""
    hermes, harmony = load_tokenizer(chat_models["hermes"]), load_tokenizer(chat_models["harmony"])
    adaptive = claude.messages.create(model="hermes", messages=USER, max_tokens=16, thinking={"type": "adaptive"},
                                      extra_body={"temperature": 0})
    enabled = claude.messages.create(model="hermes", messages=USER, max_tokens=16,
                                     thinking={"type": "enabled"},
                                     extra_body={"temperature": 0})
    assert [b.type for b in adaptive.content] == ["thinking", "text"]
    assert adaptive.content[0].thinking == enabled.content[0].thinking
    for effort, rendered in (("low", "low"), ("high", "high"), ("max", "high")):
        counted = claude.messages.count_tokens(model="harmony", messages=USER, extra_body={
            "output_config": {"effort": effort}})
        prompt = harmony.apply_chat_template(USER, add_generation_prompt=True, reasoning_effort=rendered)
        assert f"Reasoning: {rendered}" in harmony.decode(prompt) and counted.input_tokens == len(prompt)
    agent = [*USER, {"role": "assistant", "content": "On it."},
             {"role": "system", "content": "The user prefers Celsius."}, {"role": "user", "content": "And Rome?"}]
    counted = claude.messages.count_tokens(model="hermes", messages=agent)
    prompt = hermes.apply_chat_template(agent, add_generation_prompt=True)
    assert counted.input_tokens == len(prompt) and "The user prefers Celsius." in hermes.decode(prompt)
    marked = [{"role": "user", "content": [{"type": "text", "text": USER[0]["content"],
                                            "cache_control": {"type": "ephemeral"}}]}]
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert claude.messages.count_tokens(model="hermes", messages=marked, system=system).input_tokens == \
        claude.messages.count_tokens(model="hermes", messages=USER, system="Be brief.").input_tokens


def test_anthropic_clear_thinking_keeps_the_newest_turns_thinking(claude, chat_models):
    """``context_management``'s clear_thinking edit, as Claude Code sends it:
    earlier turns' thinking stays out of the prompt but the ``keep`` newest
    (one by default), and the reply reports the turns and tokens it cleared."""
    hermes = load_tokenizer(chat_models["hermes"])

    def turn(i: int) -> list[dict]:
        return [{"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": f"Pondering number {i}.",
                                                   "signature": ""}, {"type": "text", "text": f"Answer {i}."}]}]
    conversation = turn(1) + turn(2) + turn(3) + [{"role": "user", "content": "Question 4?"}]

    def rendered(kept: set[int]) -> list[int]:
        messages = []
        for m in conversation:
            if isinstance(m["content"], str):
                messages.append(m)
                continue
            i = int(m["content"][1]["text"].split()[1].rstrip("."))
            message = {"role": "assistant", "content": m["content"][1]["text"]}
            if i in kept:
                message["reasoning_content"] = m["content"][0]["thinking"]
            messages.append(message)
        return hermes.apply_chat_template(messages, add_generation_prompt=True)

    for keep, kept in ((None, {3}), ({"type": "thinking_turns", "value": 2}, {2, 3}), ("all", {1, 2, 3}),
                       ({"type": "thinking_turns", "value": 0}, set())):
        edit = {"type": "clear_thinking_20251015", **({} if keep is None else {"keep": keep})}
        body = {"context_management": {"edits": [edit]}}
        counted = claude.messages.count_tokens(model="hermes", messages=conversation, extra_body=body)
        assert counted.input_tokens == len(rendered(kept)), keep
        message = claude.messages.create(model="hermes", messages=conversation, max_tokens=4, extra_body={
            **body, "temperature": 0})
        applied = message.model_extra["context_management"]["applied_edits"]
        cleared = 3 - len(kept)
        assert applied == ([{"type": "clear_thinking_20251015", "cleared_thinking_turns": cleared,
                             "cleared_input_tokens": len(rendered({1, 2, 3})) - len(rendered(kept))}]
                           if cleared else []), keep
    plain = claude.messages.count_tokens(model="hermes", messages=conversation)
    assert plain.input_tokens == len(rendered(set()))  # without the edit, no earlier thinking is replayed


def test_anthropic_streams_report_cache_reads(claude):
    """A repeated prompt reads its prefix from the cache: the stream's
    ``message_start`` and ``message_delta`` report it as the whole reply does."""
    long_user = [{"role": "user", "content": "Tell me about the weather in Paris. " * 20}]
    claude.messages.create(model="hermes", messages=long_user, max_tokens=2, extra_body={"temperature": 0})
    whole = claude.messages.create(model="hermes", messages=long_user, max_tokens=2, extra_body={"temperature": 0})
    assert whole.usage.cache_read_input_tokens > 0
    with claude.messages.stream(model="hermes", messages=long_user, max_tokens=2,
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    for usage in (start, delta):
        assert usage.cache_read_input_tokens == whole.usage.cache_read_input_tokens
        assert usage.input_tokens == whole.usage.input_tokens


@pytest.mark.parametrize("body,param", [
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"effort": ["high"]}}, "output_config.effort"),
    ({"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits.0.type"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}},
     "context_management.edits.0.keep"),
])
def test_anthropic_bad_tool_requests_are_refused(claude, body, param):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="hermes", messages=USER, max_tokens=4, extra_body=body)
    assert param in err.value.body["error"]["message"]
