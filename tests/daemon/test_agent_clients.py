"""The real agent clients, end to end: pinned releases of Claude Code, Codex
CLI and OpenCode from npm, each pointed at a daemon on loopback (any other
traffic goes to a dead proxy), each running one non-interactive task.

The model answering is the forge's draft in the ``agent`` model's chat
conventions (tools in Hermes style, a 64k window): random weights, so its
text is nonsense, but the protocol may not be. One layer rather than the
target's four, since prefilling a client's prompt (27k to 37k tokens of
system prompt and tools) is most of a run on the CPU backend. Each client must exit 0 and report
its turn finished, and every request it made must have had a 2xx answer
(a stream the client abandoned is logged 499).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import model_manifest, start_daemon

PINNED = {"@anthropic-ai/claude-code": "2.1.332", "@openai/codex": "0.171.0", "opencode-ai": "1.18.33"}
TASK = "List the files in this directory, then say what the project is."
DEAD_PROXY = "http://127.0.0.1:9"  # discard: nothing listens there
CLIENT_TIMEOUT = 900  # a hang guard: prefilling a client's prompt is most of a run


@pytest.fixture(scope="module")
def clients() -> Path:
    """The pinned clients, installed once per pin set under the user's cache."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent clients come from the npm registry")
    pins = "-".join(f"{name.split('/')[-1]}@{version}" for name, version in PINNED.items())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specd" / "clients" / pins
    bins = root / "node_modules" / ".bin"
    if not all((bins / name).exists() for name in ("claude", "codex", "opencode")):
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(root),
                        *(f"{name}@{version}" for name, version in PINNED.items())],
                       check=True, capture_output=True, timeout=600)
    return bins


@pytest.fixture(scope="module")
def agent_daemon(forged, tmp_path_factory):
    from specd.forge import AGENT_CONTEXT
    from specd.forge.chat import chat_variant

    root = tmp_path_factory.mktemp("agent-daemon")
    agent = chat_variant(forged / "draft", root / "agent", "hermes", context=AGENT_CONTEXT)
    daemon = start_daemon(root, {"agent.yaml": model_manifest("agent", agent, maxBatchSize=4)},
                          True, "--drop-hosted-tools")
    yield daemon
    daemon.stop()


def run_client(argv: list[str], cwd: Path, home: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A client in a fresh home, its traffic to anything but loopback sent to a dead proxy."""
    home.mkdir(parents=True, exist_ok=True)
    base = {key: value for key, value in os.environ.items() if key in ("PATH", "LANG", "TERM", "USER")}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT,
                          stdin=subprocess.DEVNULL,
                          env={**base, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                               "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
                               "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "ALL_PROXY": DEAD_PROXY,
                               "NO_PROXY": "127.0.0.1,localhost", **env})


def answered(daemon, since: int) -> list[tuple[str, int]]:
    """(path, status) of each API request the daemon logged after byte ``since`` of its log."""
    requests = []
    for line in daemon.log()[since:].splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if entry.get("event") == "request" and entry.get("path", "").startswith("/v1/"):
            requests.append((entry["path"], entry["status"]))
    return requests


@pytest.fixture
def workdir(tmp_path) -> Path:
    work = tmp_path / "project"
    work.mkdir()
    (work / "README.md").write_text("# calc\nA calculator.\n")
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    return work


def check_requests(daemon, since: int, route: str) -> list[tuple[str, int]]:
    requests = answered(daemon, since)
    assert requests and all(path.startswith(route) for path, _ in requests), requests
    assert all(200 <= status < 300 for _, status in requests), requests
    return requests


def claude_env(daemon, model: str) -> dict[str, str]:
    """Claude Code pointed at ``model`` on ``daemon``, with nothing else to reach."""
    return {"ANTHROPIC_BASE_URL": daemon.url, "ANTHROPIC_API_KEY": "sk-local", "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def test_claude_code_finishes_a_turn_over_the_messages_api(clients, agent_daemon, workdir, tmp_path):
    since = len(agent_daemon.log())
    proc = run_client([str(clients / "claude"), "-p", TASK, "--output-format", "json", "--max-turns", "2"],
                      workdir, tmp_path / "home", claude_env(agent_daemon, "agent"))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(proc.stdout)
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], result
    assert result["usage"]["input_tokens"] > 1000  # its system prompt and tools reached the model
    check_requests(agent_daemon, since, "/v1/messages")


def test_codex_finishes_a_turn_over_the_responses_api(clients, agent_daemon, workdir, tmp_path):
    home = tmp_path / "home"
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(
        'model = "agent"\nmodel_provider = "specd"\nmodel_context_window = 65536\n\n'
        f'[model_providers.specd]\nname = "specd"\nbase_url = "{agent_daemon.url}/v1"\nwire_api = "responses"\n')
    since = len(agent_daemon.log())
    proc = run_client([str(clients / "codex"), "exec", "--json", "--skip-git-repo-check", TASK], workdir, home,
                      {"CODEX_HOME": str(codex_home)})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert any(e.get("type") == "turn.completed" for e in events), events
    assert not any(e.get("type") in ("turn.failed", "error") for e in events), events
    check_requests(agent_daemon, since, "/v1/responses")


def test_opencode_finishes_a_turn_over_chat_completions(clients, agent_daemon, workdir, tmp_path):
    (workdir / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": "specd/agent", "share": "disabled",
        "autoupdate": False,
        "provider": {"specd": {"npm": "@ai-sdk/openai-compatible", "name": "specd",
                               "options": {"baseURL": f"{agent_daemon.url}/v1", "apiKey": "sk-local"},
                               "models": {"agent": {"name": "agent", "limit": {"context": 65536, "output": 4096}}}}}}))
    since = len(agent_daemon.log())
    proc = run_client([str(clients / "opencode"), "run", "--format", "json", "--title", "specd e2e", TASK],
                      workdir, tmp_path / "home", {"OPENCODE_DISABLE_AUTOUPDATE": "1"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    finished = [e for e in events if e.get("type") == "step_finish"]
    assert finished and finished[-1]["part"]["reason"] in ("stop", "length", "tool-calls"), events
    assert not any(e.get("type") == "error" for e in events), events
    check_requests(agent_daemon, since, "/v1/chat/completions")


@pytest.fixture(scope="module")
def vision_agent_daemon(forged, tmp_path_factory):
    """A LLaVA checkpoint whose language model is the forge's one-layer draft, in Hermes
    conventions with image parts and a 64k window (``specd.forge.vision.agent_variant``)."""
    pytest.importorskip("mlx_vlm")
    from specd.forge import AGENT_CONTEXT
    from specd.forge.vision import agent_variant, build

    root = tmp_path_factory.mktemp("vision-agent-daemon")
    llava = build("llava", root / "llava", forged / "draft", language_model=forged / "draft")
    agent = agent_variant(llava, root / "agent-eyes", AGENT_CONTEXT)
    daemon = start_daemon(root, {"agent.yaml": model_manifest("agent-eyes", agent, maxBatchSize=4)})
    yield daemon
    daemon.stop()


def test_claude_code_sends_an_image_file_it_reads(clients, vision_agent_daemon, workdir, tmp_path):
    """``@picture.png`` in a non-interactive prompt: Claude Code reads the file and sends it as an
    image block; every request it makes is answered 2xx and the Model counts the image."""
    from PIL import Image

    from daemons import scrape

    Image.new("RGB", (64, 48), (200, 40, 40)).save(workdir / "picture.png")
    since = len(vision_agent_daemon.log())
    proc = run_client([str(clients / "claude"), "-p", "What is in @picture.png?", "--output-format", "json",
                       "--max-turns", "2"], workdir, tmp_path / "home", claude_env(vision_agent_daemon, "agent-eyes"))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(proc.stdout)
    assert result["subtype"] == "success" and not result["is_error"], result
    check_requests(vision_agent_daemon, since, "/v1/messages")
    assert scrape(vision_agent_daemon)[("specd_prompt_images_total", (("model_name", "agent-eyes"),))] >= 1
