"""What a chat turn means beyond its text: tools, tool calls and reasoning.

The OpenAI and Anthropic routes both come here to render a conversation
(tool definitions, assistant tool calls and tool results go through the
model's own chat template), to build the grammar that forces a tool call, and
to split what the model writes into reasoning, content and tool calls.

Tool-call formats follow the model's family, as mlx-lm infers it from the
chat template (``tool_parser_type``) and parses it (``mlx_lm.tool_parsers``);
Llama 3's JSON calls and gpt-oss's harmony channels, which mlx-lm does not
parse, are handled here.  A family whose format specd cannot force (Gemma's,
pythonic calls, XML arguments) is forced into the Hermes format instead,
which is parsed the same way whatever the model.
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from mlx_lm.generate import TextStateMachine
from mlx_lm.tool_parsers import json_tools, mistral

from ..core.grammar import COMPACT_JSON, GrammarError, lark_grammar
from ..core.vision import ImagesNotInPrompt, PromptImages
from .errors import bad_request
from .images import ImagePart, decode

HERMES = "json_tools"
FORCEABLE = ("json_tools", "mistral", "llama3", "harmony")  # formats a grammar can force natively


# Tools a provider runs itself (Responses API types): specd cannot, so they are refused by name, or
# dropped where the daemon runs with --drop-hosted-tools (Codex sends web_search by default)
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "computer", "computer_use_preview",
                          "code_interpreter", "image_generation", "mcp", "tool_search"})
NAMESPACE_SEPARATOR = "."  # a namespaced tool reaches the template as "namespace.name"


@dataclass(frozen=True)
class Tool:
    name: str  # as the template renders it and a call names it ("namespace.name" inside a namespace)
    parameters: dict  # a JSON schema
    description: str = ""
    namespace: str = ""  # the Responses API namespace tool that holds it

    @property
    def short_name(self) -> str:
        """The name within its namespace (a Responses function_call's ``name``)."""
        return self.name.removeprefix(self.namespace + NAMESPACE_SEPARATOR) if self.namespace else self.name


@dataclass(frozen=True)
class ChatTurn:
    """A chat request's prompt and what its output may hold."""

    prompt: list[int]
    tools: list[Tool]  # the tools a call may use (none: calls are not parsed)
    forced: bool  # a call is required, so a grammar forces one
    parallel: bool  # several calls may be made at once
    images: PromptImages | None = None  # the prompt's images, as the Model's processor made them


@dataclass(frozen=True)
class Conversation:
    """A chat request as read and checked, before any model is asked for: what
    every API's parse step returns (so a malformed request is refused without
    waiting for a Model to load), and what ``turn`` renders once the engine is
    known."""

    messages: list[dict]  # chat-template messages
    tools: list[Tool]  # the tools the template renders
    callable_tools: list[Tool]  # the tools a call may use (none: calls are not parsed)
    forced: bool  # a call is required
    parallel: bool  # several calls may be made at once
    kwargs: dict  # chat-template variables
    images: tuple[ImagePart, ...] = ()  # the images its messages hold, in order (each an image part there)

    def turn(self, engine) -> ChatTurn:
        """The prompt, through ``engine``'s chat template (a 400 if the template refuses it), its
        images decoded and through the Model's processor (a 400 if the Model takes none)."""
        if not self.images:
            prompt = render_chat(engine.tokenizer, engine.name, self.messages, self.tools, self.kwargs)
            return ChatTurn(prompt, self.callable_tools, self.forced, self.parallel)
        if engine.vision is None:
            raise bad_request(f"model '{engine.name}' takes no images: {engine.image_refusal}", self.images[0].where)
        decoded = [decode(part) for part in self.images]
        text = render_chat(engine.tokenizer, engine.name, self.messages, self.tools, self.kwargs, tokenize=False)
        try:
            prompt, images = engine.vision.prepare(text, [d.image for d in decoded], tuple(d.digest for d in decoded))
        except ImagesNotInPrompt as exc:
            raise bad_request(str(exc), self.images[0].where) from None
        return ChatTurn(prompt, self.callable_tools, self.forced, self.parallel, images)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=new_call_id)


def tool_format(tokenizer) -> str | None:
    """The model's tool-call format: an mlx-lm parser name, "llama3" or "harmony"."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if "<|channel|>" in template:
        return "harmony"
    if "<|python_tag|>" in template and '"parameters"' in template:
        return "llama3"
    return tokenizer.init_kwargs.get("tool_parser_type")


def forced_format(tokenizer) -> str:
    """The format a forced call is written in: the model's own, else Hermes."""
    fmt = tool_format(tokenizer)
    return fmt if fmt in FORCEABLE else HERMES


# -- reading a request -------------------------------------------------------------


def parse_tools(value: Any, flat: bool = False, drop_hosted: bool = False) -> list[Tool]:
    """Function tools, each with a JSON-schema ``parameters``: chat's
    ``{"type": "function", "function": {...}}``, or (``flat``) the Responses
    API's ``{"type": "function", "name": ...}`` and its ``namespace`` tools
    that group such functions.  Other types (hosted tools such as web search)
    are refused by name, since only their provider can run them; with
    ``drop_hosted`` the hosted ones are left out instead."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if drop_hosted and isinstance(kind, str) and kind in HOSTED_TOOLS:
            continue
        if flat and kind == "namespace":
            tools += _namespace_tools(tool, where)
            continue
        if kind != "function":
            raise bad_request(f"tools of type {str(kind)[:64]!r} are not supported: specd runs function tools "
                              "(hosted tools such as web search are the client's to run)", f"{where}.type")
        function = tool if flat else tool.get("function")
        if not isinstance(function, dict):
            raise bad_request("each tool must be {\"type\": \"function\", \"function\": {...}}", where)
        tools.append(_function_tool(function, where if flat else f"{where}.function"))
    if len({t.name for t in tools}) < len(tools):
        raise bad_request("tool names must be unique", "tools")
    return tools


def _tool_name(value: Any, where: str, namespace: str = "") -> str:
    if not isinstance(value, str) or not value or len(value) > 64:
        raise bad_request("a function needs a 'name' of 1 to 64 characters", where)
    if namespace and NAMESPACE_SEPARATOR in value:
        raise bad_request(f"a namespaced name may not hold {NAMESPACE_SEPARATOR!r}", where)
    return f"{namespace}{NAMESPACE_SEPARATOR}{value}" if namespace else value


def _function_tool(function: dict, at: str, namespace: str = "", lead: str = "") -> Tool:
    """A function tool; ``lead`` (its namespace's description) leads its own description."""
    name = _tool_name(function.get("name"), f"{at}.name", namespace)
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request("'parameters' must be a JSON schema object", f"{at}.parameters")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise bad_request("'description' must be a string", f"{at}.description")
    return Tool(name, parameters, " ".join(filter(None, (lead, description))), namespace)


def _namespace_tools(tool: dict, where: str) -> list[Tool]:
    """A Responses namespace's functions, each named ``namespace.name``."""
    namespace = tool.get("name")
    if not isinstance(namespace, str) or not namespace or len(namespace) > 64 or NAMESPACE_SEPARATOR in namespace:
        raise bad_request(f"a namespace needs a 'name' of 1 to 64 characters without {NAMESPACE_SEPARATOR!r}",
                          f"{where}.name")
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise bad_request("a namespace's 'tools' must be a list of function tools", f"{where}.tools")
    summary = tool.get("description") or ""
    if not isinstance(summary, str):
        raise bad_request("'description' must be a string", f"{where}.description")
    tools = []
    for j, function in enumerate(inner):
        at = f"{where}.tools[{j}]"
        kind = function.get("type") if isinstance(function, dict) else None
        if kind != "function":
            raise bad_request(f"a namespace holds function tools here, not {str(kind)[:64]!r}", f"{at}.type")
        tools.append(_function_tool(function, at, namespace, summary))
    return tools


def parse_tool_choice(value: Any, tools: list[Tool]) -> tuple[str, list[Tool]]:
    """OpenAI's ``tool_choice``: the mode ("none", "auto" or "required") and the tools a call may use."""
    if value is None:
        return ("auto" if tools else "none"), tools
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but there are no 'tools'", "tool_choice")
        return value, tools
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools'", "tool_choice")
        return "required", chosen
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}", "tool_choice")


def template_tools(tools: list[Tool]) -> list[dict]:
    """Tools as chat templates expect them (OpenAI's shape)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, arguments as objects (what templates render)."""
    if not isinstance(calls, list):
        raise bad_request("'tool_calls' must be a list", where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("a tool call needs a 'function' with a 'name'", f"{where}[{j}]")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise bad_request("tool call arguments must be a JSON object", f"{where}[{j}].function.arguments")
        out.append({"id": call.get("id") or new_call_id(), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize", "continue_final_message"}


def template_kwargs(value: Any, field_name: str = "chat_template_kwargs") -> dict:
    """``chat_template_kwargs``: extra variables for the chat template (``enable_thinking``, ...)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{field_name}' must be an object", field_name)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise bad_request(f"'{field_name}' cannot set {reserved[0]!r}", f"{field_name}.{reserved[0]}")
    return dict(value)


def render_chat(tokenizer, model: str, messages: list[dict], tools: list[Tool], kwargs: dict,
                tokenize: bool = True) -> list[int] | str:
    """The prompt: ``messages`` (and ``tools``) through the model's chat template (its
    text, where not ``tokenize``: a prompt with images goes through the processor next)."""
    if not tokenizer.has_chat_template:
        raise bad_request(f"model '{model}' has no chat template; use /v1/completions", "messages")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if tools and "tools" not in template:
        raise bad_request(f"model '{model}''s chat template does not render tools", "tools")
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=template_tools(tools) or None,
                                                 add_generation_prompt=True, tokenize=tokenize, **kwargs)
        return list(rendered) if tokenize else rendered
    except TemplateError as e:
        raise bad_request(f"the chat template refused the conversation: {e}", "messages") from None


# -- forcing a call --------------------------------------------------------------


def _call_schema(tool: Tool, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})


def _literal(tokenizer, text: str) -> str:
    """A grammar literal: a special token by id (it has no bytes to match), else the quoted text."""
    for token, added in tokenizer.added_tokens_decoder.items():
        if added.content == text and added.special:
            return f"<[{token}]>"
    return json.dumps(text)


def call_grammar(tokenizer, tools: list[Tool], parallel: bool) -> str:
    """A grammar whose every output is one call (or, ``parallel``, several) of
    one of ``tools``, in the model's format, arguments valid against its schema."""
    fmt = forced_format(tokenizer)
    lit = lambda text: _literal(tokenizer, text)  # noqa: E731
    more = ' ("\\n" call)*' if parallel else ""
    if fmt == "harmony":
        calls = " | ".join(f"{lit('<|channel|>')} {json.dumps('commentary to=functions.' + t.name + ' ')} "
                           f"{lit('<|constrain|>')} \"json\" {lit('<|message|>')} {_json(t.parameters)} "
                           f"{lit('<|call|>')}" for t in tools)
        lark = f"start: {calls}\n"
    elif fmt == "llama3":  # one call, JSON with "parameters"
        lark = "start: " + " | ".join(_json(_call_schema(t, "parameters")) for t in tools) + "\n"
    elif fmt == "mistral":
        array = {"type": "array", "items": {"anyOf": [_call_schema(t, "arguments") for t in tools]}, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        lark = f"start: {lit('[TOOL_CALLS]')} {_json(array)}\n"
    else:
        lark = (f"start: call{more}\n"
                f"call: {json.dumps(json_tools.tool_call_start + chr(10))} body {json.dumps(chr(10) + json_tools.tool_call_end)}\n"
                "body: " + " | ".join(_json(_call_schema(t, "arguments")) for t in tools) + "\n")
    try:
        return lark_grammar(lark)
    except ValueError as e:
        raise GrammarError(str(e)) from e


# -- splitting the output ---------------------------------------------------------


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class OutputSplitter:
    """Splits a choice's streamed text into content, reasoning and tool calls.

    Think tags and tool-call markers are found in the text (mlx-lm's
    ``TextStateMachine``), so a marker split across tokens is still found; a
    tool call is parsed when it closes.  A call that does not parse stays in
    the content rather than being dropped."""

    def __init__(self, tokenizer, prompt: list[int], tools: list[Tool], forced: bool):
        fmt = forced_format(tokenizer) if forced else tool_format(tokenizer)
        self.format = fmt if tools else None
        transitions: dict[str, list[tuple[str, str]]] = {"normal": []}
        initial = "normal"
        if tokenizer.has_thinking:
            transitions["normal"].append((tokenizer.think_start, "reasoning"))
            transitions["reasoning"] = [(tokenizer.think_end, "normal")]
            if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
                initial = "reasoning"  # the template opened the think block
        if self.format not in (None, "llama3"):  # llama3 calls have no marker
            start, end = self._markers(tokenizer)
            for edges in transitions.values():
                edges.append((start, "tool"))
            transitions["tool"] = [(end, "normal")] if end else []  # mistral's calls run to the end
        self.machine = TextStateMachine(transitions)
        self.state = self.machine.make_state(initial)
        self.tool_text = ""
        self.held = ""  # llama3: content that may be a JSON call, decided at the end
        self.tokenizer = tokenizer

    def _markers(self, tokenizer) -> tuple[str, str]:
        if self.format == HERMES:
            return json_tools.tool_call_start, json_tools.tool_call_end
        if self.format == "mistral":
            return mistral.tool_call_start, mistral.tool_call_end
        return tokenizer.tool_call_start, tokenizer.tool_call_end

    def feed(self, text: str, finished: bool) -> Delta:
        self.state, segments = TextStateMachine.split(self.state, text)
        if finished:
            self.state, rest, current = TextStateMachine.flush(self.state)
            segments.append((current, rest))
        delta = Delta()
        previous = None
        for state, chunk in segments:
            if previous == "tool" and state != "tool":
                self._close_call(delta)
            if state == "reasoning":
                delta.reasoning += chunk
            elif state == "tool":
                self.tool_text += chunk
            else:
                delta.content += chunk
            previous = state
        if finished and self.tool_text:
            self._close_call(delta)
        if self.format == "llama3":
            self._llama3(delta, finished)
        return delta

    def _close_call(self, delta: Delta) -> None:
        text, self.tool_text = self.tool_text, ""
        calls = parse_calls(self.format, text, self.tokenizer)
        if calls is None:
            delta.content += text
        else:
            delta.tool_calls.extend(calls)

    def _llama3(self, delta: Delta, finished: bool) -> None:
        """Llama 3 writes a call as bare JSON: content that starts with "{" is held until the end."""
        if not (self.held or delta.content.lstrip().startswith(("{", "<|python_tag|>"))):
            return
        self.held += delta.content
        delta.content = ""
        if finished:
            calls = parse_calls("llama3", self.held.removeprefix("<|python_tag|>"), self.tokenizer)
            if calls is None:
                delta.content = self.held
            else:
                delta.tool_calls.extend(calls)


def parse_calls(fmt: str | None, text: str, tokenizer) -> list[ToolCall] | None:
    """The tool calls in ``text`` (a closed tool segment), or None if it does not parse."""
    try:
        if fmt == "llama3":
            parsed = json.loads(text)
            parsed = [parsed] if isinstance(parsed, dict) else parsed
            return [ToolCall(c["name"], c.get("parameters", c.get("arguments", {}))) for c in parsed]
        parser = {HERMES: json_tools.parse_tool_call, "mistral": mistral.parse_tool_call}.get(fmt,
                                                                                            tokenizer.tool_parser)
        parsed = parser(text, None)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    parsed = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for call in parsed:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        calls.append(ToolCall(call["name"], _finite(arguments), call.get("id") or new_call_id()))
    return calls


def _finite(value: Any) -> Any:
    """Arguments that serialize as strict JSON: a number past float's range (valid JSON, which
    Python reads as infinity and would write back as ``Infinity``, which clients reject) becomes
    the largest float of its sign, a ``NaN`` literal null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else math.copysign(sys.float_info.max, value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class HarmonySplitter:
    """gpt-oss's harmony output: the analysis channel is reasoning, the final
    channel content, and a message addressed ``to=functions.NAME`` a tool call."""

    MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")

    def __init__(self) -> None:
        self.buffer = ""
        self.header = ""  # the current message's header: role, channel, recipient
        self.raw_header = ""  # the same as written, returned as content if no message follows
        self.body = ""  # a tool call's arguments, as they arrive
        self.in_message = False

    def feed(self, text: str, finished: bool) -> Delta:
        self.buffer += text
        delta = Delta()
        while (found := self._next_marker()) is not None:
            at, marker = found
            self._text(delta, self.buffer[:at])
            self.buffer = self.buffer[at + len(marker):]
            if not self.in_message:
                self.raw_header += marker
            self._marker(marker, delta)
        hold = 0 if finished else self._partial()
        self._text(delta, self.buffer[: len(self.buffer) - hold])
        self.buffer = self.buffer[len(self.buffer) - hold:]
        if finished and self.in_message:  # <|return|> and <|call|> end the output as end-of-sequence tokens
            self._marker("<|end|>", delta)
        elif finished:
            delta.content += self.raw_header
        return delta

    def _next_marker(self) -> tuple[int, str] | None:
        found = [(self.buffer.find(m), m) for m in self.MARKERS if m in self.buffer]
        return min(found) if found else None

    def _partial(self) -> int:
        """Characters at the end of the buffer that may begin a marker."""
        for n in range(min(len(self.buffer), max(map(len, self.MARKERS)) - 1), 0, -1):
            if any(m.startswith(self.buffer[-n:]) for m in self.MARKERS):
                return n
        return 0

    def _field(self, prefix: str) -> str | None:
        return next((w.removeprefix(prefix) for w in self.header.split() if w.startswith(prefix)), None)

    def _text(self, delta: Delta, text: str) -> None:
        if not self.in_message:
            self.header += text
            self.raw_header += text
        elif self._field("to=functions.") is not None:
            self.body += text
        elif self._field("channel=") == "analysis":
            delta.reasoning += text
        else:
            delta.content += text

    def _marker(self, marker: str, delta: Delta) -> None:
        if marker == "<|start|>":
            self.header = ""
        elif marker == "<|channel|>" and not self.in_message:
            self.header += " channel="
        elif marker == "<|message|>":
            self.in_message, self.body, self.raw_header = True, "", ""
        elif marker in ("<|end|>", "<|call|>", "<|return|>"):
            name = self._field("to=functions.") if self.in_message else None
            if name is not None:
                try:
                    delta.tool_calls.append(ToolCall(name, json.loads(self.body)))
                except json.JSONDecodeError:
                    delta.content += self.body
            self.in_message, self.header, self.body = False, "", ""
        # <|constrain|> only qualifies the header


def splitter(tokenizer, prompt: list[int], tools: list[Tool], forced: bool) -> OutputSplitter | HarmonySplitter:
    """How a choice's text is split: by harmony channels for gpt-oss, else by think and tool markers."""
    if tool_format(tokenizer) == "harmony":
        return HarmonySplitter()
    return OutputSplitter(tokenizer, prompt, tools, forced)
