#!/usr/bin/env python3
"""Replay captured agent sessions against specd, ``mlx_lm.server`` and vllm-mlx; find what breaks the prefix.

The fixtures (``ops/bench/fixtures/agent_sessions/<client>.json``, written by
``agent_capture.py``) hold every request that Claude Code, Codex CLI and
OpenCode sent in a multi-turn session, in order.  This script does two things
with them.

**Analysis** (in process, no server; ``--analyze-only`` stops there): each
model request is rendered to prompt tokens by specd's own code (the route's
reader, ``Conversation.turn``, the model's chat template and tokenizer), and
for each pair of consecutive requests of a session it reports whether request
i+1's prompt starts with all of request i's, and if not the first differing
token, ~200 characters of rendered text on each side of it, and the first
field of the two bodies (and of the chat-template messages specd made of them)
that differs.  With the cached tokens the daemon reported at capture it also
tells how much of request i's *reply* (which the cache holds as generated) the
next prompt reused.

**Replay**: the servers are started side by side on loopback and take each
request in turn (who goes first rotates), each session's requests in order:

* ``specd`` (the daemon, at its defaults, ``--drop-hosted-tools`` for Codex),
  every fixture on its own route;
* ``mlx_lm`` (``mlx_lm.server``, prompt cache on), which serves only
  ``/v1/chat/completions``: a Messages or Responses request is translated by
  specd's own readers into the chat-template messages, tools and template
  variables specd renders, so both render the same prompt (``--no-translate``:
  reported as not served);
* ``vllm_mlx`` (``vllm-mlx serve --continuous-batching --ssd-cache-dir``, from
  a throwaway venv, ``--vllm-mlx-python``), every fixture on its own route. It
  reports no cached tokens in its answers; they are read from its log
  (``[schedule] ... prompt_tokens=P tokens_to_prefill=T``: P - T cached). If
  it cannot be installed or started, the JSON says so with the error. It
  also saves its RAM prefix cache under ``~/.cache/vllm-mlx`` at exit and
  loads it at start: it runs with a HOME in the run's temporary directory,
  so every replay starts cold.

Per request: prompt tokens, cached tokens and fraction (as each server
reports them), time to first token (the first streamed output of any kind:
text, thinking or a tool call's arguments).  Per client and server: the
median cached fraction from the 2nd request on, and whether it is >= 95%
(the goal of issue #63).  Each request's output is capped (``--max-tokens``):
the replay measures prefill, and the server's reply is not what the next
request resends anyway (that is the captured reply).

``--restart``: specd alone, with the prefix cache's disk tier
(``prefixCache.disk``), restarted (SIGTERM, then a fresh process on the same
state directory) before every request of a session (the first
``--restart-requests``): each request's TTFT against a cold prefill of the
same request by the same process (the model served again with its prefix
cache off, as ``prefix_disk.py`` does), as a ratio; the goal is <= 0.1x from
the 2nd request on.

Usage (from the repository root, after ``source ops/env.sh``)::

    python ops/bench/agent_replay.py --analyze-only
    python ops/bench/agent_replay.py                     # all servers, all clients
    python ops/bench/agent_replay.py --restart           # writes results/agent_replay_restart.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp

import serve_vs_mlx_lm as anchor
from agent_capture import CLIENTS, FIXTURES, ROUTES, StreamReader
from spec_decode import write_result

DEFAULT_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "agent_replay.json"
RESTART_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "agent_replay_restart.json"
DEFAULT_MODEL = anchor.REPO_ROOT / "models" / "demo" / "agent"
GOAL_CACHED = 0.95
GOAL_RESTART = 0.1
CONTEXT_CHARS = 200
VLLM_SCHEDULE = re.compile(r"\[schedule\] request=(\S+) .*?prompt_tokens=(\d+) tokens_to_prefill=(\d+)")


# --------------------------------------------------------------------------
# Fixtures and rendering


def load_fixtures(directory: Path, clients: list[str]) -> dict[str, dict]:
    out = {}
    for client in clients:
        path = directory / f"{client}.json"
        if path.is_file():
            out[client] = json.loads(path.read_text())
        else:
            print(f"no fixture for {client} at {path}", file=sys.stderr)
    return out


def api(path: str) -> str:
    return "messages" if path.startswith("/v1/messages") else "responses" if path.startswith("/v1/responses") \
        else "chat"


def model_requests(fixture: dict) -> list[dict]:
    """The requests a model answered (not count_tokens, not a refused one), in order."""
    return [r for r in fixture["requests"]
            if r["path"].startswith(ROUTES) and not r["path"].startswith("/v1/messages/")
            and isinstance(r.get("body"), dict) and (r.get("response") or {}).get("prompt_tokens")]


class Renderer:
    """specd's own path from a request body to prompt tokens, in process."""

    def __init__(self, model: Path):
        from specd.core.loader import load_tokenizer

        self.tokenizer = load_tokenizer(str(model))
        self.engine = SimpleNamespace(tokenizer=self.tokenizer, name="agent")

    def conversation(self, path: str, body: dict):
        """The chat-template conversation specd reads from ``body`` (``Conversation``)."""
        kind = api(path)
        if kind == "messages":
            from specd.server.anthropic import _read
            return _read(body).conversation
        if kind == "responses":
            from specd.server.responses import _conversation
            return _conversation(body, [], drop_hosted=True)[0]
        from specd.server.openai import chat_conversation
        return chat_conversation(body)

    def tokens(self, path: str, body: dict) -> list[int]:
        return self.conversation(path, body).turn(self.engine).prompt

    def messages_only(self, path: str, body: dict) -> list[int]:
        """The prompt without the generation prompt (where the assistant's reply begins)."""
        conversation = self.conversation(path, body)
        return list(self.tokenizer.apply_chat_template(
            conversation.messages, tools=_template_tools(conversation.tools) or None, add_generation_prompt=False,
            tokenize=True, **conversation.kwargs))

    def chat_body(self, path: str, body: dict) -> dict:
        """A chat completions body that renders what specd renders for ``body`` (for mlx_lm.server)."""
        conversation = self.conversation(path, body)
        out = {"messages": conversation.messages, "tools": _template_tools(conversation.tools) or None}
        if conversation.kwargs:
            out["chat_template_kwargs"] = conversation.kwargs
        return {k: v for k, v in out.items() if v is not None}

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)


def _template_tools(tools) -> list[dict]:
    from specd.server.chat import template_tools
    return template_tools(tools)


# --------------------------------------------------------------------------
# Analysis: where does each request's prompt leave the one before?


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def clip(value: Any, limit: int = 160) -> Any:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit} chars)"


def first_difference(a: Any, b: Any, path: str = "") -> dict | None:
    """The first place (JSON path) where ``b`` stops continuing ``a``: None when ``b`` equals ``a``
    or only extends it (a longer list whose first items equal ``a``'s, a string that starts with
    ``a``'s)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in b:
                return {"path": f"{path}.{key}".lstrip("."), "change": "removed", "before": clip(a[key])}
            if key not in a:
                return {"path": f"{path}.{key}".lstrip("."), "change": "added", "after": clip(b[key])}
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        if len(b) < len(a):
            return {"path": f"{path}[{len(b)}]", "change": "removed", "before": clip(a[len(b)])}
        return None
    if a == b:
        return None
    if isinstance(a, str) and isinstance(b, str):
        n = common_prefix(a, b)
        return {"path": path.lstrip("."), "change": "text", "at_char": n,
                "before": clip(a[max(0, n - 60):n + 100], 200), "after": clip(b[max(0, n - 60):n + 100], 200)}
    return {"path": path.lstrip("."), "change": "value", "before": clip(a), "after": clip(b)}


PROMPT_FIELDS = {"messages": ("system", "tools", "messages", "thinking", "output_config", "context_management"),
                 "responses": ("instructions", "tools", "input", "reasoning"),
                 "chat": ("tools", "messages", "chat_template_kwargs", "reasoning_effort")}


def body_changes(path: str, a: dict, b: dict) -> dict[str, Any]:
    """The first change in each field the prompt is rendered from, and the other fields that changed."""
    rendered = PROMPT_FIELDS[api(path)]
    out: dict[str, Any] = {"prompt_fields": {}, "other_fields": []}
    for key in rendered:
        found = first_difference(a.get(key), b.get(key), key)
        if found:
            out["prompt_fields"][key] = found
    out["other_fields"] = sorted(k for k in set(a) | set(b) if k not in rendered and a.get(k) != b.get(k))
    return out


def analyze_pair(renderer: Renderer, prev: dict, cur: dict, p: list[int], q: list[int]) -> dict[str, Any]:
    n = common_prefix(p, q)
    live = cur["response"].get("cached_tokens")
    entry: dict[str, Any] = {
        "from": prev["index"], "to": cur["index"], "runs": [prev["run"], cur["run"]],
        "previous_prompt_tokens": len(p), "prompt_tokens": len(q), "common_prefix_tokens": n,
        "starts_with_previous_prompt": n == len(p), "previous_prompt_not_reused": len(p) - n,
        "new_tail_tokens": len(q) - n, "best_cached_fraction_without_reply": round(n / len(q), 4),
        "cached_tokens_live": live, "cached_fraction_live": cur["response"].get("cached_fraction"),
        # what the live cache reused beyond the previous prompt: the reply as generated, as far as the
        # next prompt re-rendered it token for token (the daemon's tree holds prompt + generated tokens)
        "reply_tokens_reused_live": (live - len(p)) if live is not None and n == len(p) else None,
        "previous_completion_tokens": prev["response"].get("completion_tokens"),
    }
    if n < len(p):
        # where the previous prompt's messages end: a divergence past it is in its generation prompt
        ends = renderer.messages_only(prev["path"], prev["body"])
        entry["in_generation_prompt"] = n >= common_prefix(p, ends) and len(ends) < len(p)
        entry["previous_prompt_after_divergence"] = clip(renderer.text(p[n:n + 80]), CONTEXT_CHARS)
    before = renderer.text(q[max(0, n - 80):n])[-CONTEXT_CHARS:]
    entry["divergence"] = {"token": n, "before": before,
                           "previous_side": renderer.text(p[n:n + 80])[:CONTEXT_CHARS],
                           "new_side": renderer.text(q[n:n + 80])[:CONTEXT_CHARS]}
    entry["body_changes"] = body_changes(cur["path"], prev["body"], cur["body"])
    a, b = renderer.conversation(prev["path"], prev["body"]), renderer.conversation(cur["path"], cur["body"])
    entry["template_message_change"] = first_difference(a.messages, b.messages, "messages")
    entry["template_kwargs_change"] = first_difference(a.kwargs, b.kwargs, "kwargs")
    entry["tools_changed"] = [t.name for t in a.tools] != [t.name for t in b.tools] or a.tools != b.tools
    entry["cause"] = cause(entry)
    return entry


def cause(e: dict) -> str:
    """A one-line reading of a pair (the report explains each in full)."""
    if e["starts_with_previous_prompt"]:
        reused = e.get("reply_tokens_reused_live")
        tail = (f"; the live cache also reused {reused} of the reply's {e['previous_completion_tokens']} generated "
                "tokens" if reused is not None else "")
        return "none: the prompt starts with all of the previous prompt" + tail
    fields = e["body_changes"]["prompt_fields"]
    message = e["template_message_change"]
    if e.get("in_generation_prompt"):
        return ("the previous prompt's generation prompt (" + json.dumps(e["previous_prompt_after_divergence"][:40])
                + ") is not what the reply is re-rendered with: " + (message["path"] if message else "same messages"))
    if e["tools_changed"]:
        return "the tools changed: " + json.dumps(fields.get("tools"))[:200]
    if message:
        return f"a message the previous request sent changed: {message['path']} ({message['change']})"
    if e["template_kwargs_change"]:
        return f"a template variable changed: {e['template_kwargs_change']}"
    return "the rendering changed: " + ", ".join(fields) or "unknown"


def analyze(fixtures: dict[str, dict], renderer: Renderer) -> dict[str, Any]:
    out = {}
    for client, fixture in fixtures.items():
        requests = model_requests(fixture)
        prompts = [renderer.tokens(r["path"], r["body"]) for r in requests]
        per_request = [{"index": r["index"], "run": r["run"], "path": r["path"], "rendered_tokens": len(t),
                        "captured_prompt_tokens": r["response"]["prompt_tokens"],
                        "captured_cached_tokens": r["response"].get("cached_tokens"),
                        "captured_cached_fraction": r["response"].get("cached_fraction"),
                        "forced_tool": (r.get("forwarded") or {}).get("forced_tool")}
                       for r, t in zip(requests, prompts)]
        pairs = [analyze_pair(renderer, requests[i], requests[i + 1], prompts[i], prompts[i + 1])
                 for i in range(len(requests) - 1)]
        later = [r["captured_cached_fraction"] for r in per_request[1:] if r["captured_cached_fraction"] is not None]
        best = [p["best_cached_fraction_without_reply"] for p in pairs]
        out[client] = {"version": fixture.get("version"), "requests": per_request, "pairs": pairs,
                       "rendered_matches_capture": all(r["rendered_tokens"] == r["captured_prompt_tokens"]
                                                       for r in per_request),
                       "live_cached_fraction_median_from_2nd": statistics.median(later) if later else None,
                       "live_cached_fraction_min_from_2nd": min(later) if later else None,
                       "prefix_only_fraction_median_from_2nd": statistics.median(best) if best else None}
    return out


def print_analysis(analysis: dict[str, Any]) -> None:
    for client, a in analysis.items():
        print(f"\n== {client} {a['version']}: rendered in process = captured prompt tokens: "
              f"{a['rendered_matches_capture']}; live cached fraction from the 2nd request: median "
              f"{fmt_frac(a['live_cached_fraction_median_from_2nd'])}, min {fmt_frac(a['live_cached_fraction_min_from_2nd'])}")
        for p in a["pairs"]:
            print(f"  #{p['from']}->#{p['to']} (runs {p['runs'][0]}->{p['runs'][1]}): {p['previous_prompt_tokens']} -> "
                  f"{p['prompt_tokens']} tokens, common prefix {p['common_prefix_tokens']} "
                  f"(previous prompt not reused: {p['previous_prompt_not_reused']}), live cached "
                  f"{p['cached_tokens_live']} ({fmt_frac(p['cached_fraction_live'])})")
            print(f"      cause: {p['cause']}")
            if not p["starts_with_previous_prompt"]:
                d = p["divergence"]
                print(f"      ...{d['before'][-100:]!r}\n      previous: {d['previous_side'][:100]!r}\n"
                      f"      new:      {d['new_side'][:100]!r}")
                for key, change in p["body_changes"]["prompt_fields"].items():
                    print(f"      body {key}: {json.dumps(change, ensure_ascii=False)[:300]}")


# --------------------------------------------------------------------------
# Servers


def vllm_mlx_spec(model: Path, port: int, python: Path, cache_dir: Path) -> anchor.ServerSpec:
    argv = [str(python), "-m", "vllm_mlx.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", anchor.SPECD_MODEL_ID, "--continuous-batching", "--ssd-cache-dir", str(cache_dir),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    return anchor.ServerSpec("vllm_mlx", argv, "/v1/models", anchor.SPECD_MODEL_ID)


def vllm_mlx_problem(python: Path) -> str | None:
    """Why vllm-mlx cannot run from ``python`` (None: it imports)."""
    if not python.exists():
        return (f"no interpreter at {python}: make a throwaway venv with vllm-mlx: python -m venv V; put the "
                "specd venv's site-packages in a .pth file of V's site-packages (mlx, mlx-lm, transformers); "
                "V/bin/pip install --no-deps vllm-mlx==0.6.0; V/bin/pip install uvicorn fastapi python-multipart "
                "tabulate")
    proc = subprocess.run([str(python), "-c", "import vllm_mlx, vllm_mlx.server, importlib.metadata as m; "
                           "print(m.version('vllm-mlx'), m.version('mlx-lm'), m.version('mlx'))"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return "vllm-mlx does not import: " + proc.stderr.strip()[-1500:]
    return None


def vllm_versions(python: Path) -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run([str(python), "-c", "import importlib.metadata as m; print({p: m.version(p) for p in "
                               "('vllm-mlx', 'mlx-lm', 'mlx')})"], capture_output=True, text=True,
                              timeout=120).stdout.strip()
    return None


class Server:
    """A started server: how to reach it and what it serves."""

    def __init__(self, name: str, spec: anchor.ServerSpec, port: int, log_path: Path, routes: tuple[str, ...],
                 translate: bool):
        self.name, self.spec, self.log_path, self.routes, self.translate = name, spec, log_path, routes, translate
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.log_offset = 0
        self.env: dict[str, str] = {}  # added to the environment it starts in

    def route_for(self, path: str) -> str | None:
        """The path this server is sent a request of ``path`` on (None: not served)."""
        if path.startswith(self.routes):
            return path
        return "/v1/chat/completions" if self.translate else None

    def cached_from_log(self) -> tuple[int | None, int | None]:
        """(prompt, cached) of the last request the log scheduled since the last call (vllm-mlx)."""
        text = self.log_path.read_text(errors="replace")
        new, self.log_offset = text[self.log_offset:], len(text)
        found = VLLM_SCHEDULE.findall(new)
        if not found:
            return None, None
        _, prompt, prefill = found[-1]
        return int(prompt), int(prompt) - int(prefill)


def request_body(server: Server, renderer: Renderer, entry: dict, route: str, max_tokens: int) -> dict:
    """What ``server`` is sent for a captured request: its body (or its chat translation), the server's
    model name, streamed with usage, its output capped."""
    body = dict(entry["body"])
    if api(route) != api(entry["path"]):  # translated for a chat-only server
        body = {**renderer.chat_body(entry["path"], body), **{k: body[k] for k in ("temperature", "top_p")
                                                            if k in body}}
    body["model"] = server.spec.model_id
    body["stream"] = True
    kind = api(route)
    for key in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        body.pop(key, None)
    body[{"messages": "max_tokens", "responses": "max_output_tokens", "chat": "max_tokens"}[kind]] = max_tokens
    if kind == "chat":
        body["stream_options"] = {"include_usage": True}
    if kind == "responses":
        body["store"] = False
    return body


async def send(session: aiohttp.ClientSession, server: Server, renderer: Renderer, entry: dict,
               max_tokens: int) -> dict[str, Any]:
    route = server.route_for(entry["path"])
    if route is None:
        return {"served": False, "reason": f"not served by this server ({entry['path'].split('?')[0]})"}
    body = request_body(server, renderer, entry, route, max_tokens)
    query = "?" + entry["path"].split("?", 1)[1] if "?" in entry["path"] and route == entry["path"] else ""
    started = time.perf_counter()
    reader = StreamReader(started)
    headers = {"content-type": "application/json", "x-api-key": "sk-local", "authorization": "Bearer sk-local",
               "anthropic-version": entry["headers"].get("anthropic-version", "2023-06-01")}
    async with session.post(server.base + route.split("?")[0] + query, json=body, headers=headers) as resp:
        if resp.status != 200:
            return {"served": False, "status": resp.status, "reason": (await resp.text())[:600], "route": route}
        async for chunk in resp.content.iter_any():
            reader.feed(chunk)
    out = {"served": True, "route": route, "translated": route != entry["path"], **reader.record(),
           "latency_s": time.perf_counter() - started}
    if server.name == "vllm_mlx":  # it reports no cached tokens: its scheduler's log line does
        prompt, cached = server.cached_from_log()
        out.update(cached_tokens=cached, cached_from="server log ([schedule] prompt_tokens - tokens_to_prefill)",
                   prompt_tokens_reported=out["prompt_tokens"])
        if prompt is not None:  # its Messages route reports input_tokens 0
            out["prompt_tokens"] = prompt
        if cached is not None and out["prompt_tokens"]:
            out["cached_fraction"] = round(cached / out["prompt_tokens"], 4)
    if out["cached_tokens"] is None:
        out["cached_fraction"] = None
    return out


async def start(stack: contextlib.ExitStack, session: aiohttp.ClientSession, server: Server,
                env: dict[str, str]) -> float:
    server.proc = stack.enter_context(anchor.running(server.spec, {**env, **server.env}, server.log_path))
    return await anchor.wait_ready(session, server.base, server.spec, server.proc, server.log_path)


def build_servers(names: list[str], args: argparse.Namespace, workdir: Path) -> tuple[list[Server], dict]:
    servers, problems = [], {}
    for name in names:
        port = anchor.free_port()
        log_path = workdir / f"{name}.log"
        if name == "specd":
            (workdir / "specd").mkdir()
            spec = anchor.specd_spec(args.model, workdir / "specd", port)
            spec.argv.append("--drop-hosted-tools")
            servers.append(Server(name, spec, port, log_path, ROUTES, False))
        elif name == "mlx_lm":
            spec = anchor.mlx_lm_spec(args.model, port, prompt_cache=True, backlog=64)
            servers.append(Server(name, spec, port, log_path, ("/v1/chat/completions",), args.translate))
        elif name == "vllm_mlx":
            problem = vllm_mlx_problem(args.vllm_mlx_python)
            if problem:
                problems[name] = problem
                print(f"[vllm_mlx] not run: {problem}", file=sys.stderr)
                continue
            spec = vllm_mlx_spec(args.model, port, args.vllm_mlx_python, workdir / "vllm-mlx-ssd")
            server = Server(name, spec, port, log_path, ROUTES, False)
            # it also saves its RAM prefix cache under ~/.cache/vllm-mlx at exit and loads it at start,
            # which would carry one replay's prefixes into the next: a home of its own, in the workdir
            server.env = {"HOME": str(workdir / "vllm-mlx-home")}
            servers.append(server)
    return servers, problems


async def replay(fixtures: dict[str, dict], renderer: Renderer, args: argparse.Namespace,
                 workdir: Path) -> dict[str, Any]:
    env, preload = anchor.child_env()
    servers, problems = build_servers(args.servers, args, workdir)
    out: dict[str, Any] = {name: {"error": problem} for name, problem in problems.items()}
    timeout = aiohttp.ClientTimeout(total=anchor.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with contextlib.ExitStack() as stack:
            live = []
            for server in servers:
                try:
                    ready = await start(stack, session, server, env)
                except RuntimeError as err:  # recorded, the others go on
                    out[server.name] = {"error": str(err)[-3000:], "argv": server.spec.argv}
                    print(f"[{server.name}] did not start: {str(err)[:500]}", file=sys.stderr)
                    continue
                out[server.name] = {"argv": server.spec.argv, "ready_s": ready, "clients": {}}
                live.append(server)
                print(f"[{server.name}] ready in {ready:.1f}s at {server.base}", flush=True)
            turn = 0
            for client, fixture in fixtures.items():
                for i, entry in enumerate(model_requests(fixture)):
                    turn += 1
                    order = live[turn % len(live):] + live[:turn % len(live)] if live else []
                    for server in order:
                        try:
                            result = await send(session, server, renderer, entry, args.max_tokens)
                        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                            result = {"served": False, "reason": f"{type(err).__name__}: {err}"}
                        result = {"index": entry["index"], "run": entry["run"], **result}
                        out[server.name]["clients"].setdefault(client, []).append(result)
                        print(f"[{server.name}] {client} #{entry['index']}: " + describe(result), flush=True)
            for server in live:
                out[server.name]["log_tail"] = anchor.log_tail(server.log_path, 12)
    out["openblas_preload"] = preload
    return out


def describe(r: dict) -> str:
    if not r.get("served"):
        return f"not served: {r.get('reason', '')[:200]}"
    return (f"prompt {r['prompt_tokens']}, cached {r['cached_tokens']} ({fmt_frac(r['cached_fraction'])}), "
            f"ttft {fmt_s(r['ttft_s'])}" + (" (translated to chat completions)" if r.get("translated") else ""))


def fmt_frac(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}s"


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    summary = {}
    for server, data in results.items():
        if not isinstance(data, dict) or "clients" not in data:
            continue
        for client, rows in data["clients"].items():
            served = [r for r in rows if r.get("served")]
            later = [r["cached_fraction"] for r in served[1:] if r.get("cached_fraction") is not None]
            ttfts = [r["ttft_s"] for r in served[1:] if r.get("ttft_s") is not None]
            summary.setdefault(client, {})[server] = {
                "requests": len(rows), "served": len(served),
                "not_served_reason": next((r.get("reason") for r in rows if not r.get("served")), None),
                "first_ttft_s": served[0]["ttft_s"] if served else None,
                "later_ttft_s_median": statistics.median(ttfts) if ttfts else None,
                "cached_fraction_median_from_2nd": statistics.median(later) if later else None,
                "cached_fraction_min_from_2nd": min(later) if later else None,
                "goal_cached>=0.95": (statistics.median(later) >= GOAL_CACHED) if later else None}
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print(f"\n{'client':<12} {'server':<9} {'served':>6} {'1st ttft':>9} {'later ttft':>11} "
          f"{'cached (median, 2nd on)':>24} {'min':>7}  goal >= 95%")
    for client, row in summary.items():
        for server, s in row.items():
            if not s["served"]:
                print(f"{client:<12} {server:<9} {'0':>6}  {s['not_served_reason'][:70]}")
                continue
            goal = {True: "PASS", False: "FAIL", None: "n/a"}[s["goal_cached>=0.95"]]
            print(f"{client:<12} {server:<9} {s['served']:>6} {fmt_s(s['first_ttft_s']):>9} "
                  f"{fmt_s(s['later_ttft_s_median']):>11} {fmt_frac(s['cached_fraction_median_from_2nd']):>24} "
                  f"{fmt_frac(s['cached_fraction_min_from_2nd']):>7}  {goal}")


# --------------------------------------------------------------------------
# Restart mode


async def restart_replay(fixtures: dict[str, dict], renderer: Renderer, args: argparse.Namespace,
                         workdir: Path) -> dict[str, Any]:
    """Each session's requests on specd restarted before every request, on one state directory.

    The daemon serves the model twice, as ``prefix_disk.py`` does: ``bench`` with the prefix
    cache's disk tier (``prefixCache.disk``) and ``cold`` with the prefix cache off.  Before each
    request the daemon is stopped (SIGTERM: it writes what is queued) and started again; the request
    goes to ``bench`` (its prefix, if any, read back from disk), then the same request to ``cold``:
    a cold prefill of it, on the same warm process."""
    from prefix_disk import manifests, metric

    env, _ = anchor.child_env()
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=anchor.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for client, fixture in fixtures.items():
            requests = model_requests(fixture)
            requests = requests[:args.restart_requests] if args.restart_requests else requests
            state = workdir / f"restart-{client}"
            manifests(args.model, state / "manifests")
            rows = []
            for i, entry in enumerate(requests):
                port = anchor.free_port()
                argv = [sys.executable, "-m", "specd.cli", "daemon", "--manifests", str(state / "manifests"),
                        "--state-dir", str(state / "state"), "--host", "127.0.0.1", "--port", str(port),
                        "--drop-hosted-tools"]
                spec = anchor.ServerSpec("specd", argv, "/readyz", "bench")
                bench = Server("specd", spec, port, state / f"specd-{i}.log", ROUTES, False)
                cold = Server("specd", replace(spec, model_id="cold"), port, bench.log_path, ROUTES, False)
                with contextlib.ExitStack() as stack:
                    ready = await start(stack, session, bench, env)
                    restarted = await send(session, bench, renderer, entry, args.max_tokens)
                    cold_result = await send(session, cold, renderer, entry, args.max_tokens)
                    disk = {name: await metric(session, bench.base, f"specd_prefix_disk_{name}")
                            for name in ("hit_tokens_total", "read_bytes_total", "restore_seconds_sum")}
                a, b = restarted.get("ttft_s"), cold_result.get("ttft_s")
                row = {"index": entry["index"], "run": entry["run"], "ready_s": ready, "restarted": restarted,
                       "cold": cold_result, "disk": disk, "ttft_ratio": a / b if a is not None and b else None}
                rows.append(row)
                print(f"[specd restarted] {client} #{entry['index']}: {describe(restarted)}; cold {describe(cold_result)}; "
                      f"restarted/cold TTFT {fmt_x(row['ttft_ratio'])}; disk hit {disk['hit_tokens_total']:.0f} tokens",
                      flush=True)
            ratios = [r["ttft_ratio"] for r in rows[1:] if r["ttft_ratio"] is not None]
            out[client] = {"requests": rows, "ttft_ratio_median_from_2nd": statistics.median(ratios) if ratios else None,
                           "ttft_ratio_max_from_2nd": max(ratios) if ratios else None,
                           "goal_ratio<=0.1": (max(ratios) <= GOAL_RESTART) if ratios else None}
    return out


def fmt_x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


# --------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fixtures", type=Path, default=FIXTURES)
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=CLIENTS)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="the model every server serves (it must share the captured model's tokenizer)")
    p.add_argument("--servers", nargs="+", default=["specd", "mlx_lm", "vllm_mlx"],
                   choices=["specd", "mlx_lm", "vllm_mlx"])
    p.add_argument("--max-tokens", type=int, default=8, help="output cap of each replayed request")
    p.add_argument("--no-translate", dest="translate", action="store_false",
                   help="do not translate Messages/Responses requests to chat completions for mlx_lm.server")
    p.add_argument("--vllm-mlx-python", type=Path,
                   default=Path(os.environ.get("VLLM_MLX_PYTHON", "/tmp/vllm-mlx-venv/bin/python")),
                   help="the interpreter of a throwaway venv holding vllm-mlx")
    p.add_argument("--analyze-only", action="store_true", help="only the in-process prefix analysis")
    p.add_argument("--restart", action="store_true",
                   help="specd restarted between requests, TTFT against a cold prefill of each request")
    p.add_argument("--restart-requests", type=int, default=4,
                   help="requests per session in --restart mode (0: all)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON results (default {DEFAULT_OUT.name}, with --restart {RESTART_OUT.name}, in ops/bench/results)")
    args = p.parse_args(argv)
    args.out = args.out or (RESTART_OUT if args.restart else DEFAULT_OUT)
    args.model = args.model.expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fixtures = load_fixtures(args.fixtures, args.clients)
    if not fixtures:
        print("no fixtures: run ops/bench/agent_capture.py first", file=sys.stderr)
        return 1
    renderer = Renderer(args.model)
    analysis = analyze(fixtures, renderer)
    print_analysis(analysis)
    result: dict[str, Any] = {
        "benchmark": "agent_replay", "created_unix": time.time(), "model": str(args.model),
        "fixtures": {c: {"client": f["client"], "package": f.get("package"), "version": f.get("version"),
                         "captured": f.get("captured"), "capture_model": f.get("model"),
                         "model_requests": len(model_requests(f))} for c, f in fixtures.items()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "host": anchor.host_info(),
        "versions": {p: anchor.package_version(p) for p in ("specd", "mlx", "mlx-lm", "aiohttp")},
        "analysis": analysis}
    if not args.analyze_only:
        signal_exit()
        with tempfile.TemporaryDirectory(prefix="agent-replay-") as tmp:
            if args.restart:
                result["mode"] = "restart"
                result["restart"] = asyncio.run(restart_replay(fixtures, renderer, args, Path(tmp)))
                for client, r in result["restart"].items():
                    print(f"{client}: restarted/cold TTFT from the 2nd request: median "
                          f"{fmt_x(r['ttft_ratio_median_from_2nd'])}, max {fmt_x(r['ttft_ratio_max_from_2nd'])} "
                          f"(goal <= {GOAL_RESTART}x: {r['goal_ratio<=0.1']})")
            else:
                result["mode"] = "replay"
                if "vllm_mlx" in args.servers:
                    result["versions"]["vllm_mlx_venv"] = vllm_versions(args.vllm_mlx_python)
                result["servers"] = asyncio.run(replay(fixtures, renderer, args, Path(tmp)))
                result["summary"] = summarize(result["servers"])
                print_summary(result["summary"])
    write_result(str(args.out), result)
    return 0


def signal_exit() -> None:
    """SIGTERM becomes SystemExit so the servers are stopped, as Ctrl-C does."""
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


if __name__ == "__main__":
    sys.exit(main())
