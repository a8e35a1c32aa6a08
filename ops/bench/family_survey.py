#!/usr/bin/env python3
"""Every model family the installed mlx-lm ships: specd and ``mlx_lm.server`` side by side.

Each family's tiny random-weight model (``specd.forge.families.build``, as the
tests build it) gets the same four prompts as four concurrent greedy
``/v1/completions`` of 40 tokens on one ``mlx_lm.server`` (batching on, as its
users run it; it loads each family's directory on demand from the request's
``model`` field, and is restarted when a family kills it), and on specd's
engine, without speculation and with n-gram speculation.  Each answer is
compared with ``mlx_lm.generate``'s greedy tokens for that prompt alone.

What it records per family: ``same`` (all four equal the prompt alone), ``k of
4 differ``, or the error, for mlx_lm.server, specd and specd with n-gram.  The
JSON keeps every text; ``--only`` runs some families.

Usage (from the repository root)::

    python ops/bench/family_survey.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import mlx.core as mx

import serve_vs_mlx_lm as anchor

REPO_ROOT = anchor.REPO_ROOT
sys.path.insert(0, str(REPO_ROOT))

from specd.core.loader import load_model  # noqa: E402
from specd.core.memory import reuse_freed_memory  # noqa: E402
from specd.core.request import GenerationRequest, SpeculationConfig  # noqa: E402
from specd.core.sampling import SamplingParams  # noqa: E402
from specd.engine.engine import Engine  # noqa: E402
from specd.engine.scheduler import EngineConfig  # noqa: E402
from specd.forge import forge  # noqa: E402
from specd.forge.families import METAL_ONLY, NOT_SERVED, UNFORGEABLE, build, model_types  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "family_survey.json"
PROMPTS = anchor.PROMPTS[:4]
MAX_TOKENS = 40
NGRAM = SpeculationConfig("ngram", 4, 1, 3)


def alone(model, tokenizer, prompt: str) -> str:
    """mlx-lm's greedy completion of ``prompt`` by itself, as text."""
    from mlx_lm.generate import generate_step

    tokens = []
    for token, _ in generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=MAX_TOKENS):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return tokenizer.decode(tokens)


async def specd_texts(model, tokenizer, spec: SpeculationConfig | None) -> list[str]:
    """The four prompts at once on specd's engine."""
    engine = Engine("survey", model, tokenizer, EngineConfig(max_batch_size=4))
    engine.start()

    async def one(i: int, prompt: str) -> str:
        request = GenerationRequest(f"s{i}", tokenizer.encode(prompt), SamplingParams(temperature=0), MAX_TOKENS,
                                    (), spec)
        text = ""
        async for out in engine.generate(request):
            if out.error is not None:
                raise RuntimeError(out.error)
            text += out.text
        return text
    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
    finally:
        await engine.shutdown(1)


class MlxLmServer:
    """One ``mlx_lm.server``, restarted when a family kills it."""

    def __init__(self, default_model: Path, workdir: Path):
        self.default_model, self.workdir = default_model, workdir
        self.env, _ = anchor.child_env()
        self.proc = None
        self.base = ""
        self.starts = 0
        self.processes = contextlib.ExitStack()

    async def ensure(self, session: aiohttp.ClientSession) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        port = anchor.free_port()
        spec = anchor.mlx_lm_spec(self.default_model, port, prompt_cache=True, backlog=64)
        self.log = self.workdir / f"mlx_lm-{self.starts}.log"
        self.proc = self.processes.enter_context(anchor.running(spec, self.env, self.log))
        self.base, self.starts = f"http://127.0.0.1:{port}", self.starts + 1
        await anchor.wait_ready(session, self.base, spec, self.proc, self.log)

    def stop(self) -> None:
        self.processes.close()
        self.proc = None

    async def texts(self, session: aiohttp.ClientSession, model: Path) -> list[str]:
        await self.ensure(session)

        async def one(prompt: str) -> str:
            body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            async with session.post(self.base + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=300)) as resp:
                answer = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {answer[:200]}")
                return json.loads(answer)["choices"][0]["text"]
        try:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            died = self.proc.poll() is not None
            self.stop()
            raised = [line.strip() for line in anchor.log_tail(self.log, 400).splitlines()
                      if re.match(r"\s*\w+(Error|Exception): ", line) and "generation thread died" not in line]
            cause = raised[0] if raised else f"{type(e).__name__}: {e}"
            raise RuntimeError(f"{'the server died' if died else 'connection dropped'}: {cause}") from None


def build_model(family: str, root: Path) -> Path:
    """The family's tiny model; a Metal-only family is built in a child process,
    since its forward (which building runs) may corrupt this one's heap on the CPU."""
    out = root / family
    if family not in METAL_ONLY:
        return build(family, out, root / "forge" / "target", seed=0)
    script = ("import sys; from specd.forge.families import build; "
              "build(sys.argv[1], sys.argv[2], sys.argv[3], seed=0)")
    done = subprocess.run([sys.executable, "-c", script, family, str(out), str(root / "forge" / "target")],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ChildProcessError(lines[-1])  # the child's own exception line
    return out


def verdict(texts: list[str] | str, expected: list[str] | None) -> str:
    if isinstance(texts, str):
        return texts  # an error
    if expected is None:
        return "served (no reference)"
    differ = sum(t != e for t, e in zip(texts, expected))
    return "same" if differ == 0 else f"{differ} of {len(texts)} differ"


async def attempt(coroutine) -> list[str] | str:
    try:
        return await coroutine
    except Exception as e:  # a family's failure is this survey's finding
        return f"error: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"


async def survey(families: list[str], root: Path) -> list[dict[str, Any]]:
    forge(root / "forge", preset="test", seed=0, log=lambda *a, **k: None)
    server = MlxLmServer(root / "forge" / "target", root)
    rows = []
    async with aiohttp.ClientSession() as session:
        try:
            for family in families:
                started = time.monotonic()
                row: dict[str, Any] = {"family": family}
                if family in UNFORGEABLE or family in NOT_SERVED:  # mlx-lm cannot import olmo's module either
                    row["skipped"] = UNFORGEABLE.get(family) or NOT_SERVED[family]
                    rows.append(row)
                    continue
                try:
                    path = build_model(family, root)
                except Exception as e:
                    what = str(e) if isinstance(e, ChildProcessError) else f"{type(e).__name__}: {e}"
                    row["skipped"] = f"cannot be built: {what}"[:200]
                    rows.append(row)
                    continue
                expected, model, tokenizer = None, None, None
                if family not in METAL_ONLY:  # these fail or abort in-process
                    model, tokenizer = load_model(str(path))
                    expected = [alone(model, tokenizer, p) for p in PROMPTS]
                served = await attempt(server.texts(session, path))
                row["mlx_lm_server"] = verdict(served, expected)
                if model is not None:
                    row["specd"] = verdict(await attempt(specd_texts(model, tokenizer, None)), expected)
                    row["specd_ngram"] = verdict(await attempt(specd_texts(model, tokenizer, NGRAM)), expected)
                else:
                    row["specd"] = row["specd_ngram"] = "not run: " + METAL_ONLY[family]
                row["texts"] = {"alone": expected, "mlx_lm_server": served}
                row["seconds"] = round(time.monotonic() - started, 1)
                print(f"{family:28s} mlx_lm.server: {row['mlx_lm_server']:40.40s} specd: {row['specd']:12.12s} "
                      f"n-gram: {row['specd_ngram']:12.12s}", flush=True)
                rows.append(row)
        finally:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    reuse_freed_memory()  # the C heap as the daemon sets it (specd/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these families only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    families = args.only or model_types()
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(survey(families, Path(tmp)))
    versions = {name: anchor.package_version(name) for name in ("mlx", "mlx-lm")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"versions": versions, "host": anchor.host_info(), "families": rows}, indent=1))
    tally: dict[str, int] = {}
    for row in rows:
        for key in ("mlx_lm_server", "specd", "specd_ngram"):
            if key in row:
                outcome = row[key] if row[key] == "same" or row[key].startswith(("error", "not run")) else "differ"
                tally[f"{key}: {outcome.split(':')[0]}"] = tally.get(f"{key}: {outcome.split(':')[0]}", 0) + 1
    print(json.dumps(tally, indent=1, sort_keys=True))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
