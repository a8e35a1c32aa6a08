"""OpenAI's Responses API: ``/v1/responses`` (create, retrieve, delete, input items).

The same engine path as chat (``completion.EngineRun``).  ``instructions``
and ``input`` (a string, or items: messages of any role, ``function_call``
and ``function_call_output`` items, ``reasoning`` items) become the chat
template's conversation; function ``tools``, ``tool_choice`` and
``parallel_tool_calls`` mean what they mean in chat, a forced call enforced
by the same grammar; ``text.format`` is enforced through the grammar as
``response_format`` is; ``reasoning.effort`` is the template's
``reasoning_effort`` (``reasoning.summary`` is accepted: the reasoning comes
back whole, as the item's content).  The output is split into ``reasoning``, ``message``
and ``function_call`` items, whole or as the events the SDK's
``responses.stream()`` parses.

``store`` (the default) keeps the response and the conversation it answered
(``ResponseStore``); ``previous_response_id`` continues it, rendered again, so
the prefix cache finds its KV.  Reasoning asked for with ``include:
["reasoning.encrypted_content"]`` comes back as an opaque string that specd
reads again when a client sends the item back (as Codex does with ``store:
false``).  Hosted tools (web search, file search, computer use, ...) are
refused by name: specd cannot run them.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

from aiohttp import web

from ..core.request import StepOutput
from ..core.sampling import SamplingParams
from .chat import NAMESPACE_SEPARATOR, ChatTurn, Conversation, Delta, Tool, parse_tools
from .completion import (EngineRun, ParsedRequest, check_constraints, engine_named, event_stream, images_fetched,
                         integer_field, model_request, number_field, off_loop, read_json)
from .errors import APIError, bad_request
from .images import Content, ImageParts
from .keys import DROP_HOSTED_TOOLS, RESPONSES

routes = web.RouteTableDef()
# what /v1/responses reads; ``metadata``, ``user``, ``prompt_cache_key`` (the prefix cache needs no key),
# ``client_metadata``, ``service_tier`` and ``truncation: disabled`` change nothing that is generated
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning",
          "max_output_tokens", "temperature", "top_p", "metadata", "prompt_cache_key", "include", "store",
          "previous_response_id", "stream", "user", "service_tier", "client_metadata", "truncation"}
INCLUDES = {"reasoning.encrypted_content"}
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high"}
SEALED = "specd-reasoning:"  # what specd's encrypted_content starts with


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _seal(text: str) -> str:
    return SEALED + base64.b64encode(text.encode()).decode()


def _unseal(value: Any) -> str:
    """The reasoning in an item specd sealed; another server's stays unread."""
    if isinstance(value, str) and value.startswith(SEALED):
        try:
            return base64.b64decode(value[len(SEALED):], validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            return ""
    return ""


# -- reading a request -------------------------------------------------------------


def _items(body: dict) -> list[dict]:
    """``input`` as a list of items."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise bad_request("'input' must be a string or a list of items", "input")
    return value


def _content(content: Any, where: str, images: ImageParts) -> str | list[dict]:
    """A message's text (a string, or text parts: input_text, output_text), or where it holds
    ``input_image`` parts, its text and image parts in order (as a vision model's template takes them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("'content' must be a string or a list of content parts", where)
    out = Content()
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal") if kind == "refusal" else part.get("text") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal") and isinstance(text, str):
            out.text(text)
        elif kind == "input_image":
            out.image(_input_image(part, f"{where}[{j}]", images))
        else:
            raise bad_request(f"content parts of type {kind!r} are not supported", f"{where}[{j}].type")
    return out.value()


def _input_image(part: dict, where: str, images: ImageParts) -> dict:
    """An ``input_image`` part: a data URL in ``image_url`` (no file ids: specd stores no files)."""
    for key in part:
        if key not in ("type", "image_url", "detail"):
            raise bad_request(f"'{str(key)[:64]}' is not supported on an input_image (send image_url)",
                              f"{where}.{str(key)[:64]}")
    if part.get("detail", "auto") != "auto":
        raise bad_request("specd sizes an image as the model's processor does: 'detail' must be auto",
                          f"{where}.detail")
    return images.data_url(part.get("image_url"), f"{where}.image_url")


def _reasoning_text(item: dict) -> str:
    parts = item.get("content") or item.get("summary") or []
    text = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
    return text or _unseal(item.get("encrypted_content"))


def conversation(instructions: Any, items: list[dict], images: ImageParts) -> list[dict]:
    """Input items as chat-template messages: ``developer`` speaks as system,
    a ``function_call`` joins the assistant message before it (or opens one),
    its output is a tool message, and a ``reasoning`` item's text is the next
    assistant message's ``reasoning_content``."""
    messages: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    names: dict[str, str] = {}
    reasoning = ""
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request("a message's role must be user, assistant, system or developer", f"{where}.role")
            message = {"role": "system" if role == "developer" else role,
                       "content": _content(item.get("content"), f"{where}.content", images)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            namespace = item.get("namespace")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, str):
                raise bad_request("a function_call needs a 'name', a 'call_id' and 'arguments' (a JSON string)",
                                  where)
            if namespace is not None:
                if not isinstance(namespace, str):
                    raise bad_request("'namespace' must be a string", f"{where}.namespace")
                name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
            try:
                parsed = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise bad_request("'arguments' must be a JSON object", f"{where}.arguments") from None
            names[call_id] = name
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request("a function_call_output needs its 'call_id'", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, ""),
                             "content": _content(output if output is not None else "", f"{where}.output", images)})
        elif kind == "reasoning":
            reasoning += _reasoning_text(item)
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", f"{where}.type")
    return messages


def _tool_choice(value: Any, tools: list[Tool]) -> tuple[list[Tool], bool]:
    """The tools a call may use, and whether a call is required."""
    if value is None or value == "auto":
        return tools, False
    if value == "none":
        return [], False
    if value == "required":
        if not tools:
            raise bad_request("'tool_choice' is 'required' but there are no 'tools'", "tool_choice")
        return tools, True
    if isinstance(value, dict) and value.get("type") == "function":
        chosen = [t for t in tools if (t.short_name, t.namespace) == (value.get("name"), value.get("namespace") or "")]
        if not chosen:
            raise bad_request(f"'tool_choice' names function {value.get('name')!r}, which is not in 'tools'",
                              "tool_choice.name")
        return chosen, True
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def _text_format(body: dict) -> dict | None:
    """``text.format``: text, ``json_object`` or ``json_schema`` (enforced by the grammar)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("'text' may hold 'format' (and 'verbosity')", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' other than medium is not supported: a template has no such setting",
                          "text.verbosity")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return fmt["schema"]
    raise bad_request("'text.format' must be text, json_object or json_schema with a 'schema'", "text.format")


def _template_kwargs(body: dict) -> dict:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise bad_request("'reasoning' may hold 'effort' and 'summary'", "reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise bad_request("'reasoning.effort' must be minimal, low, medium or high", "reasoning.effort")
    return {"reasoning_effort": EFFORTS[effort]}


def _checked(body: Any) -> dict:
    model_request(body, FIELDS)
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad_request("'include' must be a list", "include")
    for i, value in enumerate(include):
        if not isinstance(value, str) or value not in INCLUDES:
            raise bad_request(f"include[{i}]: {str(value)[:64]!r} is not supported; specd can include "
                              f"{sorted(INCLUDES)}", f"include[{i}]")
    if not isinstance(body.get("metadata", {}), dict):
        raise bad_request("'metadata' must be an object", "metadata")
    for key in ("store", "stream", "parallel_tool_calls"):
        if not isinstance(body.get(key, True), bool):
            raise bad_request(f"'{key}' must be a boolean", key)
    if body.get("truncation", "disabled") != "disabled":
        raise bad_request("'truncation' must be 'disabled': specd never drops input to fit", "truncation")
    return body


def _parse(body: dict) -> ParsedRequest:
    params = SamplingParams(temperature=number_field(body, "temperature", 0.0, 2.0, 1.0),
                            top_p=number_field(body, "top_p", 0.0, 1.0, 1.0) or 1.0)
    return ParsedRequest(body["model"], body.get("stream", False), False, integer_field(body, "max_output_tokens", 1),
                         (), params, None, 1, _text_format(body), "text.format", "text.format.schema")


def _conversation(body: dict, earlier: list[dict], drop_hosted: bool) -> tuple[Conversation, list[dict]]:
    """The conversation, checked (no engine needed), and every input item it holds (``earlier`` ones first)."""
    items = earlier + _items(body)
    if not items:
        raise bad_request("'input' must hold at least one item", "input")
    tools = parse_tools(body.get("tools"), flat=True, drop_hosted=drop_hosted)
    callable_tools, forced = _tool_choice(body.get("tool_choice"), tools)
    images = ImageParts()
    messages = conversation(body.get("instructions"), items, images)
    if not messages:  # reasoning items alone: nothing to answer
        raise bad_request("'input' must hold a message or a function call", "input")
    return Conversation(messages, tools, callable_tools, forced, body.get("parallel_tool_calls", True),
                        _template_kwargs(body), tuple(images.parts)), items


# -- answering ------------------------------------------------------------------


def _reasoning_item(text: str, sealed: bool) -> dict:
    item = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}
    if sealed:
        item["encrypted_content"] = _seal(text)
    return item


def _message_item(text: str) -> dict:
    return {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call, tools: dict[str, Tool]) -> dict:
    """A ``function_call`` item; a call of a namespaced tool names its function and its namespace."""
    tool = tools.get(call.name)
    item = {"type": "function_call", "id": _new_id("fc"), "call_id": call.id,
            "name": tool.short_name if tool is not None else call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False), "status": "completed"}
    if tool is not None and tool.namespace:
        item["namespace"] = tool.namespace
    return item


def _output(delta: Delta, sealed: bool, tools: dict[str, Tool]) -> list[dict]:
    out = [_reasoning_item(delta.reasoning, sealed)] if delta.reasoning else []
    if delta.content.strip() or not delta.tool_calls:
        out.append(_message_item(delta.content))
    return out + [_call_item(call, tools) for call in delta.tool_calls]


class _Response:
    """The response object, from its creation to its last output."""

    def __init__(self, run: EngineRun, body: dict, turn: ChatTurn, previous: str | None):
        self.run, self.body, self.prompt = run, body, len(turn.prompt)
        self.tools = {tool.name: tool for tool in turn.tools}
        self.sealed = "reasoning.encrypted_content" in (body.get("include") or [])
        self.object = {
            "id": run.id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": run.engine.name, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": previous,
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "text": body.get("text") or {"format": {"type": "text"}}, "store": body.get("store", True),
            "usage": None}

    def finish(self, last: StepOutput, output: list[dict]) -> dict:
        reasoning = sum(len(self.run.engine.tokenizer.encode(part["text"])) for item in output
                        if item["type"] == "reasoning" for part in item["content"])
        self.object.update(
            status="incomplete" if last.finish_reason == "length" else "completed", output=output,
            incomplete_details={"reason": "max_output_tokens"} if last.finish_reason == "length" else None,
            usage={"input_tokens": self.prompt, "input_tokens_details": {"cached_tokens": last.cached_tokens},
                   "output_tokens": last.completion_tokens,
                   "output_tokens_details": {"reasoning_tokens": min(reasoning, last.completion_tokens)},
                   "total_tokens": self.prompt + last.completion_tokens})
        return self.object


class _Events:
    """The streamed output items: an item opens when the kind of output
    changes (reasoning, text, a function call) and is done before the next."""

    def __init__(self, send, sealed: bool, tools: dict[str, Tool]):
        self.send, self.sealed, self.tools = send, sealed, tools
        self.items: list[dict] = []
        self.open: str | None = None
        self.called = False

    async def add(self, delta: Delta) -> None:
        if delta.reasoning:
            await self._text("reasoning", delta.reasoning)
        if delta.content and (self.open == "message" or delta.content.strip() or not self.called):
            await self._text("message", delta.content)
        for call in delta.tool_calls:
            await self.close()
            self.called = True
            item = _call_item(call, self.tools)
            self.items.append(item)
            index = len(self.items) - 1
            await self.send("response.output_item.added", {"output_index": index, "item": {
                **item, "arguments": "", "status": "in_progress"}})
            await self.send("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                                       "delta": item["arguments"]})
            await self.send("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                      "arguments": item["arguments"]})
            await self.send("response.output_item.done", {"output_index": index, "item": item})

    async def _text(self, kind: str, text: str) -> None:
        if self.open != kind:
            await self.close()
            item = _reasoning_item("", False) if kind == "reasoning" else _message_item("")
            self.items.append(item)
            self.open = kind
            part = dict(item["content"][0])
            await self.send("response.output_item.added", {"output_index": len(self.items) - 1,
                                                           "item": {**item, "content": [], "status": "in_progress"}})
            await self.send("response.content_part.added", {**self._where(), "part": part})
        if not text:
            return
        self.items[-1]["content"][0]["text"] += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        await self.send(event, {**self._where(), "delta": text, **({} if kind == "reasoning" else {"logprobs": []})})

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    async def close(self) -> None:
        if self.open is None:
            return
        item, kind = self.items[-1], self.open
        self.open = None
        text = item["content"][0]["text"]
        event = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        await self.send(event, {**self._where(), "text": text, **({} if kind == "reasoning" else {"logprobs": []})})
        await self.send("response.content_part.done", {**self._where(), "part": item["content"][0]})
        if kind == "reasoning" and self.sealed:
            item["encrypted_content"] = _seal(text)
        await self.send("response.output_item.done", {"output_index": len(self.items) - 1, "item": item})


async def _stream(request: web.Request, run: EngineRun, response: _Response,
                  store: Any, items: list[dict]) -> web.StreamResponse:
    async with event_stream(request, run) as (http, first, outputs):
        sequence = 0

        async def send(event: str, data: dict) -> None:
            nonlocal sequence
            payload = json.dumps({"type": event, "sequence_number": sequence, **data})
            sequence += 1
            await http.write(f"event: {event}\ndata: {payload}\n\n".encode())

        events, splitter = _Events(send, response.sealed, response.tools), run.splitters[0]
        try:
            await send("response.created", {"response": response.object})
            await send("response.in_progress", {"response": response.object})
            last = first[1]
            await events.add(splitter.feed(last.text, finished=last.finish_reason is not None))
            async for _, out in outputs:
                await events.add(splitter.feed(out.text, finished=out.finish_reason is not None))
                last = out
            if not events.called and not any(item["type"] == "message" for item in events.items):
                await events._text("message", "")  # as whole: an output without calls has its message
            await events.close()
            done = response.finish(last, events.items)
            if done["store"]:
                store.put(done, items)
            await send("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                       {"response": done})
            await http.write_eof()
        except APIError as err:
            await send("error", {"code": err.code or err.type, "message": err.message, "param": err.param})
    return http


@routes.post("/v1/responses")
async def create(request: web.Request) -> web.StreamResponse:
    body = _checked(await read_json(request))
    parsed = _parse(body)
    store = request.app[RESPONSES]
    previous = body.get("previous_response_id")
    earlier: list[dict] = []
    if previous is not None:
        found = store.get(previous) if isinstance(previous, str) else None
        if found is None:
            raise APIError(404, f"no stored response with id {str(previous)[:80]!r} (it may have expired, or been "
                           "created with store: false)", "invalid_request_error", "previous_response_id")
        earlier = found[1] + found[0]["output"]
    # the whole request is checked before its Model is asked for: a malformed one loads nothing
    chat, items = _conversation(body, earlier, request.app[DROP_HOSTED_TOOLS])
    check_constraints(parsed, chat)
    chat = await images_fetched(request, chat)
    engine = await engine_named(request, parsed.model, parsed.stream)
    turn = await off_loop(lambda: chat.turn(engine))
    run = await off_loop(lambda: EngineRun(engine, parsed, turn.prompt, turn, _new_id("resp")))
    response = _Response(run, body, turn, previous)
    if parsed.stream:
        return await _stream(request, run, response, store, items)
    text, last = [], None
    async for _, out in run.merged():
        text.append(out.text)
        last = out
    output = _output(run.splitters[0].feed("".join(text), finished=True), response.sealed, response.tools)
    done = response.finish(last, output)
    if done["store"]:
        store.put(done, items)
    return web.json_response(done)


def _stored(request: web.Request) -> tuple[dict, list[dict]]:
    response_id = request.match_info["response_id"]
    found = request.app[RESPONSES].get(response_id)
    if found is None:
        raise APIError(404, f"no stored response with id {response_id[:80]!r}", "invalid_request_error",
                       "response_id")
    return found


@routes.get("/v1/responses/{response_id}")
async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(_stored(request)[0])


@routes.delete("/v1/responses/{response_id}")
async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSES].delete(response_id):
        raise APIError(404, f"no stored response with id {response_id[:80]!r}", "invalid_request_error",
                       "response_id")
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


@routes.get("/v1/responses/{response_id}/input_items")
async def input_items(request: web.Request) -> web.Response:
    items = [{"id": item.get("id") or f"item_{i}", **item} for i, item in enumerate(_stored(request)[1])]
    return web.json_response({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                              "last_id": items[-1]["id"] if items else None, "has_more": False})
