#!/usr/bin/env python3
"""Capture multi-turn sessions of the real agent clients against specd, as fixtures.

Each pinned client (Claude Code, Codex CLI, OpenCode: the pins of
``tests/daemon/test_agent_clients.py``, installed as that test installs them)
runs one session of several non-interactive runs in one project directory and
one fresh HOME: a task, then follow-ups that continue the same session
(``claude -c -p``, ``codex exec resume --last``, ``opencode run --continue``).
Its traffic goes to a small recording reverse proxy in this script, which
forwards every request to a specd daemon serving the agent model and records,
in order, each request (method, path, the headers that are not secrets, its
JSON body) and what the daemon answered (status, prompt and cached tokens, time
to first token, the kinds and sizes of the output blocks; not their text, which
the client's next request resends anyway).  Every other address goes to a dead
proxy, as in the client tests.

One fixture per client, ``ops/bench/fixtures/agent_sessions/<client>.json``,
holds the client's package and version, the date, the model and daemon, the
runs (argv, exit status) and the requests in order; ``agent_replay.py``
replays them and analyses where each client's requests break the prompt
prefix.

The model's replies are nonsense (the forged demo models are random-ish), but
the protocol is real: a session's later requests resend the earlier turns as
the client keeps them.  Two changes to what is *forwarded* (the recorded body
is the client's; each request's ``forwarded`` says what changed; neither
changes the rendered prompt): ``--max-tokens`` caps each request's output,
and a stop at that cap is told to the client as the model's own end (Claude
Code and Codex would retry or fail on a cut reply), so a run ends in seconds
rather than the client's 32,000-token budget; and the first request of each
run in ``--tool-runs`` is made to call a read-only tool of the client's
(``FORCED_TOOLS``, once, uncapped), since the random model never calls one, so
the session holds tool calls and results.  The demo model's replies cut at
the cap are thinking only (it never closes ``<think>``).

Run ``tests/daemon/test_agent_clients.py`` once first, or have npm: the
clients are installed where that test installs them.

Usage (from the repository root, after ``source ops/env.sh``)::

    python ops/bench/agent_capture.py                       # all three clients
    python ops/bench/agent_capture.py --clients codex --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

import serve_vs_mlx_lm as anchor

sys.path[:0] = [str(anchor.REPO_ROOT / "tests"), str(anchor.REPO_ROOT / "tests" / "daemon")]
from test_agent_clients import PINNED, run_client  # noqa: E402  the pins and the sandbox of the client tests

FIXTURES = anchor.REPO_ROOT / "ops" / "bench" / "fixtures" / "agent_sessions"
CLIENTS = ("claude-code", "codex", "opencode")
PACKAGES = {"claude-code": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai"}
BINARIES = {"claude-code": "claude", "codex": "codex", "opencode": "opencode"}
# The session: a task, then follow-ups continuing it (each a run of the client, one request or more)
PROMPTS = ("List the files in this directory, then say what the project is.",
           "Now read calc.py and explain what add() does.",
           "Suggest a unit test for add().",
           "Summarize what we did in this session in two sentences.",
           "Is there anything else in this project worth looking at?",
           "Thanks, that is all.")
# Headers worth keeping: everything but secrets and hop-by-hop ones
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding",
               "content-encoding", "upgrade", "te", "trailer"}
# Where each API keeps its output budget
# A read-only tool each client's session is made to call (the random model calls none by itself)
FORCED_TOOLS = {"claude-code": "Read", "codex": "get_goal", "opencode": "read"}
BUDGET_FIELDS = ("max_tokens", "max_output_tokens", "max_completion_tokens")
DEFAULT_BUDGET = {"/v1/responses": "max_output_tokens", "/v1/chat/completions": "max_tokens",
                  "/v1/messages": "max_tokens"}


# --------------------------------------------------------------------------
# The recording proxy


class StreamReader:
    """Usage, time to first token and the output's shape, from an SSE stream (or a JSON body) of
    any of the three APIs."""

    def __init__(self, started: float):
        self.started, self.buffer = started, b""
        self.ttft_s: float | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.stop: str | None = None
        self.blocks: dict[str, int] = {}  # output kind -> characters
        self.tool_calls: list[str] = []
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in self.buffer:
            raw, self.buffer = self.buffer.split(b"\n\n", 1)
            data = "\n".join(line[5:].strip() for line in raw.decode(errors="replace").split("\n")
                             if line.startswith("data:"))
            if data and data != "[DONE]":
                with contextlib.suppress(json.JSONDecodeError):
                    self.event(json.loads(data))

    def whole(self, body: bytes) -> None:
        """A non-streamed answer."""
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
            value = json.loads(body)
            if isinstance(value, dict):
                self.event({"type": "whole", **value})

    def _content(self, kind: str, text: Any) -> None:
        if isinstance(text, str) and text:
            self.blocks[kind] = self.blocks.get(kind, 0) + len(text)
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.started

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens are the uncached ones
            self.cached_tokens = usage.get("cache_read_input_tokens") or 0
            self.prompt_tokens = (usage.get("input_tokens") or 0) + self.cached_tokens
        elif "input_tokens" in usage:  # Responses
            self.prompt_tokens = usage["input_tokens"]
            self.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        elif "prompt_tokens" in usage:  # chat completions
            self.prompt_tokens = usage["prompt_tokens"]
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for key in ("output_tokens", "completion_tokens"):
            if usage.get(key) is not None:
                self.completion_tokens = usage[key]

    def event(self, e: dict) -> None:
        self.events += 1
        kind = e.get("type")
        if kind == "message_start":  # Anthropic
            self._usage((e.get("message") or {}).get("usage"))
        elif kind == "content_block_start" and (e.get("content_block") or {}).get("type") == "tool_use":
            self.tool_calls.append(e["content_block"].get("name"))
        elif kind == "content_block_delta":
            delta = e.get("delta") or {}
            self._content(delta.get("type", "delta"), delta.get("text") or delta.get("thinking")
                          or delta.get("partial_json"))
        elif kind == "message_delta":
            self._usage(e.get("usage"))
            self.stop = (e.get("delta") or {}).get("stop_reason") or self.stop
        elif isinstance(kind, str) and kind.startswith("response."):  # Responses
            if kind.endswith(".delta"):
                self._content(kind[len("response."):-len(".delta")], e.get("delta"))
            elif kind == "response.output_item.added" and (e.get("item") or {}).get("type") == "function_call":
                self.tool_calls.append(e["item"].get("name"))
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                response = e.get("response") or {}
                self._usage(response.get("usage"))
                self.stop = response.get("status")
        elif "choices" in e:  # chat completions (streamed or whole)
            self._usage(e.get("usage"))
            for choice in e.get("choices") or []:
                delta = choice.get("delta") or choice.get("message") or {}
                for field in ("reasoning_content", "reasoning", "content"):
                    self._content(field, delta.get(field))
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    if function.get("name"):
                        self.tool_calls.append(function["name"])
                    self._content("tool_call", function.get("arguments") or function.get("name"))
                self.stop = choice.get("finish_reason") or self.stop
        elif kind == "whole":  # a whole Anthropic message or Responses object
            self._usage(e.get("usage"))
            self.stop = e.get("stop_reason") or e.get("status")
            for block in e.get("content") or e.get("output") or []:
                if isinstance(block, dict):
                    self.blocks[block.get("type", "?")] = self.blocks.get(block.get("type", "?"), 0) + 1

    def record(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "cached_fraction": (round(self.cached_tokens / self.prompt_tokens, 4)
                                    if self.prompt_tokens and self.cached_tokens is not None else None),
                "completion_tokens": self.completion_tokens, "ttft_s": self.ttft_s, "stop": self.stop,
                "output_chars": self.blocks, "tool_calls": self.tool_calls}


ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")  # the model requests (not count_tokens)


def forced_call(path: str, tool: str) -> dict:
    """The fields that make a request call ``tool``, once, in the shape of ``path``'s API."""
    if path.startswith("/v1/messages"):
        return {"tool_choice": {"type": "tool", "name": tool, "disable_parallel_tool_use": True}}
    if path.startswith("/v1/responses"):
        return {"tool_choice": {"type": "function", "name": tool}, "parallel_tool_calls": False}
    return {"tool_choice": {"type": "function", "function": {"name": tool}}, "parallel_tool_calls": False}


def natural_end(event: dict) -> dict | None:
    """``event`` with a stop at the output cap told as the model's own end (None: left as it is)."""
    kind = event.get("type")
    if kind == "message_delta" and (event.get("delta") or {}).get("stop_reason") == "max_tokens":
        return {**event, "delta": {**event["delta"], "stop_reason": "end_turn"}}
    if kind == "response.incomplete":
        response = {**event.get("response", {}), "status": "completed", "incomplete_details": None}
        return {**event, "type": "response.completed", "response": response}
    if any(c.get("finish_reason") == "length" for c in event.get("choices") or []):
        return {**event, "choices": [{**c, "finish_reason": "stop" if c.get("finish_reason") == "length"
                                      else c.get("finish_reason")} for c in event["choices"]]}
    return None


def retold(block: bytes) -> bytes:
    """One SSE event (without its blank line) with ``natural_end`` applied."""
    lines = block.decode(errors="replace").split("\n")
    data = "\n".join(line[5:].strip() for line in lines if line.startswith("data:"))
    try:
        event = natural_end(json.loads(data)) if data and data != "[DONE]" else None
    except json.JSONDecodeError:
        event = None
    if event is None:
        return block + b"\n\n"
    named = any(line.startswith("event:") for line in lines)
    return ((f"event: {event['type']}\n" if named else "") + f"data: {json.dumps(event)}\n\n").encode()


class Recorder:
    """A reverse proxy to ``upstream`` that records every request and its answer.

    Two changes to what is forwarded (never to what is recorded), both to keep a session of a
    random model short and still an ordinary session to the client: each request's output is
    capped at ``max_tokens`` and a stop at that cap is told to the client as the model's own end
    (else Claude Code and Codex treat it as an error and retry); and the first model request of
    each run in ``force`` gets a ``tool_choice`` naming that run's tool (uncapped), so the session
    holds tool calls and their results, which the model would not make by itself.  Neither
    changes the prompt the daemon renders."""

    def __init__(self, upstream: str, max_tokens: int | None, force: dict[int, str]):
        self.upstream, self.max_tokens, self.force = upstream, max_tokens, force
        self.requests: list[dict[str, Any]] = []
        self.run = 0  # the client run the next requests belong to
        self.forced_runs: set[int] = set()
        self.session: aiohttp.ClientSession | None = None

    def forwarded(self, path: str, body: Any) -> tuple[dict | None, str | None, bool]:
        """The body to forward instead (None: as sent), the tool it forces, whether it is capped."""
        if not isinstance(body, dict) or not path.startswith(ROUTES) or path.startswith("/v1/messages/"):
            return None, None, False
        tool = self.force.get(self.run) if self.run not in self.forced_runs else None
        if tool is not None and any(t.get("name") == tool or (t.get("function") or {}).get("name") == tool
                                    for t in body.get("tools") or []):
            self.forced_runs.add(self.run)
            return {**body, **forced_call(path, tool)}, tool, False
        if self.max_tokens is None:
            return None, None, False
        field = next((k for k in BUDGET_FIELDS if k in body), None)
        if field is None:  # Codex and OpenCode may send no budget
            field = next(f for p, f in DEFAULT_BUDGET.items() if path.startswith(p))
        elif not isinstance(body[field], int) or body[field] <= self.max_tokens:
            return None, None, False
        return {**body, field: self.max_tokens}, None, True

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
            body = json.loads(raw) if raw else None
        changed, forced, capped = self.forwarded(request.path, body)
        entry: dict[str, Any] = {
            "index": len(self.requests), "run": self.run, "at_s": round(time.time(), 3),
            "method": request.method, "path": request.path_qs,
            "headers": {k.lower(): v for k, v in request.headers.items()
                        if k.lower() not in SECRET_HEADERS | HOP_HEADERS},
            "body": body if body is not None or not raw else raw.decode(errors="replace")[:2000],
            "forwarded": {"forced_tool": forced, "output_cap": self.max_tokens if capped else None}}
        self.requests.append(entry)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        started = time.perf_counter()
        reader = StreamReader(started)
        status = None
        try:
            async with self.session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                            data=raw if changed is None else json.dumps(changed).encode()) as upstream:
                status = upstream.status
                response = web.StreamResponse(status=upstream.status, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
                await response.prepare(request)
                streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
                whole = pending = b""
                async for chunk in upstream.content.iter_any():
                    if not streamed:
                        whole += chunk
                        await response.write(chunk)
                        continue
                    reader.feed(chunk)
                    if not capped:
                        await response.write(chunk)
                        continue
                    pending += chunk.replace(b"\r\n", b"\n")
                    *blocks, pending = pending.split(b"\n\n")
                    if blocks:
                        await response.write(b"".join(retold(block) for block in blocks))
                if pending:
                    await response.write(pending)
                if not streamed:
                    reader.whole(whole)
                with contextlib.suppress(ConnectionResetError):  # a client may close as soon as it has the end
                    await response.write_eof()
                return response
        except (ConnectionResetError, asyncio.CancelledError):
            status = 499  # the client left before the end (as the daemon logs it)
            raise
        finally:
            entry["response"] = {"status": status, "latency_s": round(time.perf_counter() - started, 3),
                                 **reader.record()}
            if isinstance(entry["response"]["ttft_s"], float):
                entry["response"]["ttft_s"] = round(entry["response"]["ttft_s"], 3)
            print(f"    request {entry['index']} {request.method} {request.path_qs} -> {status}"
                  f"{' (forced ' + forced + ')' if forced else ''}: prompt {reader.prompt_tokens}, "
                  f"cached {reader.cached_tokens}, out {reader.completion_tokens}, ttft {entry['response']['ttft_s']}, "
                  f"stop {reader.stop}, calls {reader.tool_calls[:4]}", flush=True)


@contextlib.asynccontextmanager
async def recording_proxy(upstream: str, max_tokens: int | None, force: dict[int, str]):
    recorder = Recorder(upstream, max_tokens, force)
    app = web.Application(client_max_size=256 * 2**20)
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = anchor.free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=anchor.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        recorder.session = session
        await site.start()
        try:
            yield recorder, f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


# --------------------------------------------------------------------------
# The clients


def client_bins() -> Path:
    """Where ``tests/daemon/test_agent_clients.py`` installs the pinned clients."""
    pins = "-".join(f"{name.split('/')[-1]}@{version}" for name, version in PINNED.items())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specd" / "clients" / pins
    bins = root / "node_modules" / ".bin"
    if not all((bins / name).exists() for name in BINARIES.values()):
        npm = shutil.which("npm")
        if npm is None:
            raise SystemExit("npm is not installed: the agent clients come from the npm registry")
        import subprocess
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(root),
                        *(f"{name}@{version}" for name, version in PINNED.items())],
                       check=True, capture_output=True, timeout=600)
    return bins


def project(root: Path) -> Path:
    """The project the clients work in (the client tests' one)."""
    work = root / "project"
    work.mkdir()
    (work / "README.md").write_text("# calc\nA calculator.\n")
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    return work


def session_runs(client: str, bins: Path, base: str, model: str, home: Path, work: Path,
                 turns: int) -> tuple[list[list[str]], dict[str, str]]:
    """The argv of each run of ``client``'s session, and its environment (config files written)."""
    exe = str(bins / BINARIES[client])
    prompts = PROMPTS[:turns]
    if client == "claude-code":
        env = {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-local", "ANTHROPIC_MODEL": model,
               "ANTHROPIC_SMALL_FAST_MODEL": model, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        common = ["--output-format", "json", "--max-turns", "3"]
        return [[exe, *([] if i == 0 else ["-c"]), "-p", p, *common] for i, p in enumerate(prompts)], env
    if client == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "specd"\nmodel_context_window = 65536\n\n'
            f'[model_providers.specd]\nname = "specd"\nbase_url = "{base}/v1"\nwire_api = "responses"\n')
        first = [exe, "exec", "--json", "--skip-git-repo-check", prompts[0]]
        later = [[exe, "exec", "--json", "--skip-git-repo-check", "resume", "--last", p] for p in prompts[1:]]
        return [first, *later], {"CODEX_HOME": str(codex_home)}
    if client == "opencode":
        (work / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json", "model": f"specd/{model}", "share": "disabled",
            "autoupdate": False,
            "provider": {"specd": {"npm": "@ai-sdk/openai-compatible", "name": "specd",
                                   "options": {"baseURL": f"{base}/v1", "apiKey": "sk-local"},
                                   "models": {model: {"name": model,
                                                      "limit": {"context": 65536, "output": 4096}}}}}}))
        first = [exe, "run", "--format", "json", "--title", "specd capture", prompts[0]]
        later = [[exe, "run", "--format", "json", "--continue", p] for p in prompts[1:]]
        return [first, *later], {"OPENCODE_DISABLE_AUTOUPDATE": "1"}
    raise ValueError(client)


async def capture(client: str, bins: Path, daemon_url: str, model_id: str, args: argparse.Namespace,
                  workdir: Path) -> dict[str, Any]:
    root = workdir / client
    root.mkdir()
    work, home = project(root), root / "home"
    home.mkdir()
    runs = []
    force = {run: FORCED_TOOLS[client] for run in args.tool_runs}
    async with recording_proxy(daemon_url, args.max_tokens, force) as (recorder, base):
        argvs, env = session_runs(client, bins, base, model_id, home, work, args.turns)
        for i, argv in enumerate(argvs):
            recorder.run = i
            print(f"  [{client}] run {i + 1}/{len(argvs)}: {' '.join(a if len(a) < 60 else a[:57] + '...' for a in argv[1:])}",
                  flush=True)
            started = time.perf_counter()
            proc = await asyncio.to_thread(run_client, argv, work, home, env)
            runs.append({"argv": [Path(argv[0]).name, *argv[1:]], "returncode": proc.returncode,
                         "wall_s": round(time.perf_counter() - started, 1),
                         "stderr_tail": proc.stderr[-600:] if proc.returncode else ""})
            print(f"  [{client}] run {i + 1} exited {proc.returncode} in {runs[-1]['wall_s']}s", flush=True)
            if proc.returncode:
                print(proc.stdout[-1500:], proc.stderr[-1500:], sep="\n", file=sys.stderr)
                break
        requests = recorder.requests
    return {"client": client, "package": PACKAGES[client], "version": PINNED[PACKAGES[client]],
            "node": shutil.which("node") and os.popen("node --version").read().strip(),
            "captured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "workdir": str(work), "home": str(home), "runs": runs, "requests": requests}


async def main_async(args: argparse.Namespace) -> int:
    bins = client_bins()
    env, preload = anchor.child_env()
    with tempfile.TemporaryDirectory(prefix="agent-capture-") as tmp:
        workdir = Path(tmp)
        (workdir / "specd").mkdir()
        spec = anchor.specd_spec(args.model, workdir / "specd", anchor.free_port())
        spec.argv.append("--drop-hosted-tools")  # Codex sends web_search (docs/clients.md)
        port = int(spec.argv[spec.argv.index("--port") + 1])
        url = f"http://127.0.0.1:{port}"
        log_path = workdir / "specd.log"
        async with aiohttp.ClientSession() as session:
            with anchor.running(spec, env, log_path) as proc:
                ready = await anchor.wait_ready(session, url, spec, proc, log_path)
                print(f"specd serving {args.model} as {spec.model_id!r} at {url} (ready in {ready:.1f}s)", flush=True)
                for client in args.clients:
                    fixture = await capture(client, bins, url, spec.model_id, args, workdir)
                    fixture["model"] = {"path": str(args.model.relative_to(anchor.REPO_ROOT))
                                        if args.model.is_relative_to(anchor.REPO_ROOT) else str(args.model),
                                        "id": spec.model_id, "forge": anchor.forge_info(args.model)}
                    fixture["daemon"] = {"argv": [Path(a).name if a == sys.executable else a for a in spec.argv[1:]],
                                         "versions": {p: anchor.package_version(p) for p in ("specd", "mlx", "mlx-lm")},
                                         "openblas_preload": preload}
                    fixture["capture"] = {
                        "prompts": list(PROMPTS[:args.turns]),
                        "output_cap": args.max_tokens, "forced_tool": FORCED_TOOLS[client],
                        "forced_runs": args.tool_runs,
                        "note": ("what was forwarded differs from the recorded body in two ways only (see each "
                                 "request's 'forwarded'): the output budget capped at output_cap, a stop there told "
                                 "to the client as the model's own end; and the first model request of each forced "
                                 "run sent with a tool_choice naming forced_tool. Neither changes the prompt.")}
                    out = args.out / f"{client}.json"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
                    served = [r for r in fixture["requests"] if (r.get("response") or {}).get("prompt_tokens")]
                    print(f"[{client}] {len(fixture['requests'])} requests ({len(served)} with usage) -> {out} "
                          f"({out.stat().st_size / 1024:.0f} KiB)", flush=True)
                    for r in served:
                        res = r["response"]
                        print(f"    #{r['index']} run {r['run']}: prompt {res['prompt_tokens']:>6}, "
                              f"cached {res['cached_tokens']!s:>6} ({res['cached_fraction']}), ttft {res['ttft_s']}s")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=CLIENTS)
    p.add_argument("--model", type=Path, default=anchor.REPO_ROOT / "models" / "demo" / "agent",
                   help="the agent model the daemon serves (a chat template that renders tools, a long window)")
    p.add_argument("--turns", type=int, default=4, help=f"client runs per session (at most {len(PROMPTS)})")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="cap on each forwarded request's output budget (0: the client's own)")
    p.add_argument("--tool-runs", type=int, nargs="*", default=[0, 2],
                   help="runs whose first request is made to call the client's read-only tool")
    p.add_argument("--out", type=Path, default=FIXTURES)
    args = p.parse_args(argv)
    if not 1 <= args.turns <= len(PROMPTS):
        p.error(f"--turns must be 1 to {len(PROMPTS)}")
    args.max_tokens = args.max_tokens or None
    args.model = args.model.expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
