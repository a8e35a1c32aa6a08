"""Speculative decoding benchmark: plain vs n-gram vs draft, in process, side by side.

Runs the specd engine itself (no HTTP) on a forged pair and measures, per
configuration, output tokens/s (median of several runs), the acceptance rate
alpha, and next to the measured speedup the ideal one from the cost model

    ideal = (1 - alpha^(k+1)) / ((1 - alpha) * (k*c + v))

where c = draft step cost / target step cost and v = cost of verifying k+1
tokens / cost of one target step, both measured here on the same models.
When a proposer skips some steps (n-gram finds no match) or proposes fewer
than k tokens, the same model is applied per step: with a fraction f of steps
speculating with k' proposals on average, ideal = (f * E[tokens | alpha, k'] +
(1 - f)) / (f * (k' * c + v(k')) + (1 - f)).

That formula assumes every proposal is accepted independently with
probability alpha.  Real acceptance is correlated (a run of predictable text
is accepted whole), so it can under-predict the tokens a round yields.  The
benchmark therefore also prints ``ideal@L``: the same cost model with the
*measured* mean accepted length L per round in place of E[tokens | alpha, k].
Efficiency = measured speedup / ideal@L: what the engine delivers of what
its acceptance and costs allow.

    python ops/bench/spec_decode.py --pair models/demo [--target-dir target-inflated]

Run with OpenBLAS preloaded (``source ops/env.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from specd.core.loader import load_model as load  # as the daemon loads (core.cpu_jit first)
from specd.core.cache import make_row_cache
from specd.core.memory import reuse_freed_memory
from specd.engine.engine import Engine
from specd.engine.scheduler import EngineConfig
from specd.core.sampling import SamplingParams
from specd.core.request import GenerationRequest, SpecStats
from specd.core.request import Method, NO_SPECULATION, SpeculationConfig
from specd.speculation.config import PolicySettings
from specd.speculation.dflash.checkpoint import load_dflash
from specd.speculation.eagle.checkpoint import load_head
from specd.speculation.mtp.checkpoint import NoMTPHead, load_mtp_head

CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]

REWRITE_SOURCE = '''def parse_header(line):
    """Split a header line into its name and value."""
    name, _, value = line.partition(":")
    name = name.strip().lower()
    value = value.strip()
    if not name:
        raise ValueError("empty header name")
    return name, value


def parse_headers(lines):
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers
'''


def rewrite_prompts() -> list[str]:
    """Edit-style prompts: the model is asked to write a given text again,
    so most of the answer already appears in the prompt (prompt lookup's case)."""
    first = REWRITE_SOURCE.split("\n", 1)[0]
    return [
        f"# Original version:\n{REWRITE_SOURCE}\n\n# Same code, reformatted:\n{first}\n",
        f"{REWRITE_SOURCE}\n\n# A copy of the functions above:\n{first}\n",
    ]


_ids = itertools.count()
RESULTS = Path(__file__).resolve().parent / "results"  # where results go, whatever the working directory


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_cost(model, context: int, width: int, batch: int = 1, reps: int = 30) -> float:
    """Median seconds of one forward of ``width`` tokens per row, for ``batch``
    rows with ``context`` tokens already cached (the engine's batched cache)."""
    cache = make_row_cache(model, [0] * batch)
    mx.eval(model(mx.zeros((batch, context), dtype=mx.int32) + 5, cache=cache.layers))
    inputs = mx.zeros((batch, width), dtype=mx.int32) + 7
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(model(inputs, cache=cache.layers))
        times.append(time.perf_counter() - start)
        cache.rollback([width] * batch)
    return median(times)


def cost_model(target, draft, ks: list[int], batch: int = 1, context: int = 96, rounds: int = 5) -> dict[str, Any]:
    """c and v(k) measured on these models with ``batch`` sequences decoding together: each a median
    over ``rounds`` of ratios whose two steps were timed one right after the other (this machine's
    speed drifts between spells by more than neighbouring k differ)."""
    step_cost(target, context, 1, batch, reps=10)  # warm-up: first calls pay allocation and thread start-up
    step_cost(draft, context, 1, batch, reps=10)
    t1, d1, v = [], [], {k: [] for k in ks}
    for _ in range(rounds):
        t1.append(step_cost(target, context, 1, batch, reps=10))
        d1.append(step_cost(draft, context, 1, batch, reps=10))
        for k in ks:
            v[k].append(step_cost(target, context, k + 1, batch, reps=10) / t1[-1])
    return {"batch": batch, "target_step_s": median(t1), "draft_step_s": median(d1),
            "c": median([d / t for d, t in zip(d1, t1)]), "v": {k: median(r) for k, r in v.items()}}


def verify_cost(v: dict[int, float], k: float) -> float:
    """v at a fractional k (the mean proposal of rounds whose k varied): linear between the
    measured ks, v(0) being a plain step's 1."""
    known = {0: 1.0, **v}
    below = max(j for j in known if j <= k)
    above = min((j for j in known if j >= k), default=below)
    if above == below:
        return known[below]
    return known[below] + (known[above] - known[below]) * (k - below) / (above - below)


def iid_tokens(alpha: float, k: float) -> float:
    """Expected tokens per round when each proposal is accepted with probability alpha."""
    return (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def ideal_speedup(tokens_per_round: float, k: float, c: float, v: float, f: float = 1.0) -> float:
    """Tokens per unit of target-step time, relative to plain decoding."""
    return (f * tokens_per_round + (1 - f)) / (f * (k * c + v) + (1 - f))


def closed_loop(prompts: list[list[int]], concurrency: int, min_requests: int) -> list[list[list[int]]]:
    """``concurrency`` clients' prompts, so that a run has at least
    ``min_requests`` requests (at concurrency 1 a client sends several, one after another)."""
    per_client = max(1, min_requests // concurrency)
    return [[prompts[(i + j * concurrency) % len(prompts)] for j in range(per_client)] for i in range(concurrency)]


async def serve_clients(engine: Engine, clients: list[list[list[int]]], specs: list[SpeculationConfig],
                        max_tokens: int, grammar: str | None = None) -> dict[str, Any]:
    """Client i sends its prompts one after another with ``specs[i]`` (and
    ``grammar``), all clients at once (greedy): aggregate output tokens/s,
    speculation totals, decode steps, and every request's tokens."""
    finished: list[tuple[int, SpecStats | None]] = []  # per request: tokens, speculation totals

    async def one(i: int, prompt: list[int]) -> list[int]:
        request = GenerationRequest(f"c{next(_ids)}", prompt, SamplingParams(temperature=0), max_tokens,
                                    speculation=specs[i], grammar=grammar)
        tokens, spec = [], None
        async for out in engine.generate(request):
            if out.error is not None:  # a failed request is an error, not a slow one
                raise RuntimeError(f"request {request.request_id} failed: {out.error}")
            tokens += out.tokens
            spec = out.spec or spec
        finished.append((len(tokens), spec))
        return tokens

    async def client(i: int, prompts: list[list[int]]) -> list[list[int]]:
        return [await one(i, p) for p in prompts]

    start = time.perf_counter()
    outputs = await asyncio.gather(*(client(i, ps) for i, ps in enumerate(clients)))
    seconds = time.perf_counter() - start
    tokens = sum(n for n, _ in finished)
    rounds, drafted, accepted = (sum(getattr(s, field) for _, s in finished if s)
                                 for field in ("rounds", "drafted", "accepted"))
    # decode steps after each request's first (prefill) token: rounds plus plain steps
    steps = sum(n - 1 - (s.accepted if s else 0) for n, s in finished)
    return {"tokens": tokens, "wall_s": seconds, "tok_s": tokens / seconds, "drafted": drafted,
            "accepted": accepted, "rounds": rounds, "steps": steps,
            "acceptance_length": 1 + accepted / rounds if rounds else 1.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "outputs": outputs}


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    """What a result file records about the run and the machine."""
    return {"args": vars(args), "platform": platform.platform(), "cpus": os.cpu_count(),
            "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", "")}


def write_result(path: str, result: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {out}")


async def one_run(engine: Engine, prompts: list[list[int]], spec, max_tokens: int,
                  concurrency: int) -> dict[str, Any]:
    """Serving ``prompts`` in groups of ``concurrency``: tokens/s and speculation totals."""
    totals = {"tokens": 0, "wall_s": 0.0, "drafted": 0, "accepted": 0, "rounds": 0, "steps": 0}
    for i in range(0, len(prompts), concurrency):
        group = prompts[i:i + concurrency]  # all at once
        r = await serve_clients(engine, [[p] for p in group], [spec or NO_SPECULATION] * len(group), max_tokens)
        for key in totals:
            totals[key] += r[key]
    totals["tok_s"] = totals["tokens"] / totals["wall_s"]
    return totals


async def measure(engine: Engine, prompts: list[list[int]], spec, max_tokens: int, runs: int,
                  concurrency: int) -> dict[str, Any]:
    """Median over ``runs`` of serving ``prompts`` in groups of ``concurrency``."""
    return summarize([await one_run(engine, prompts, spec, max_tokens, concurrency) for _ in range(runs)])


async def interleaved(engine: Engine, prompts: list[list[int]], configs: dict[str, tuple], max_tokens: int,
                      runs: int, concurrency: int, learn_runs: int = 0) -> dict[str, dict[str, Any]]:
    """Each configuration ((speculation, policy, drafter)) measured ``runs`` times, the
    configurations taken in turn run by run, so each run's ratio to the first configuration
    compares runs side by side (``paired``: their median): this machine's speed drifts by more
    than the gains measured between spells of a minute. The engine's drafter (draft model,
    EAGLE or MTP head) is swapped between runs where a configuration asks for another. The
    first ``learn_runs`` turns are not measured: what the engine learns (acceptance, step costs,
    goodput's measured steps) it keeps, per drafter, as a daemon serving for a while has.

    Before any turn the first configuration runs once unmeasured: the target's prefix cache then
    holds every prompt for each configuration alike. Otherwise the first measured run alone would
    prefill them (about a sixth of its time at eight rows), and its pairs would flatter the others."""
    async def run(name: str) -> dict[str, Any]:
        spec, policy, drafter = configs[name]
        if drafter is not None and engine.drafter_module is not drafter:
            engine.configure_speculation(NO_SPECULATION, drafter)
            while engine.drafter_module is not drafter:  # applied between the engine's steps
                await asyncio.sleep(0.001)
        engine.set_policy(policy, None if policy is None else "goodput-default")
        return await one_run(engine, prompts, spec, max_tokens, concurrency)

    per_run: dict[str, list[dict]] = {name: [] for name in configs}
    await run(next(iter(configs)))
    for turn in range(learn_runs + runs):
        for name in configs:
            measured = await run(name)
            if turn >= learn_runs:
                per_run[name].append(measured)
    engine.set_policy(None, None)
    base = per_run[next(iter(configs))]
    return {name: {**summarize(rs), "paired": median([r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)])}
            for name, rs in per_run.items()}


def summarize(per_run: list[dict[str, Any]]) -> dict[str, Any]:
    """The median tokens/s, and acceptance over all runs pooled: greedy runs emit the same
    tokens, but not the same rounds once the cost model or goodput changes k between runs."""
    rounds, drafted, accepted, steps = (sum(r[field] for r in per_run)
                                        for field in ("rounds", "drafted", "accepted", "steps"))
    return {"tok_s": median([r["tok_s"] for r in per_run]), "runs": per_run,
            "alpha": accepted / drafted if drafted else None,
            "mean_accepted": accepted / rounds if rounds else None,
            "mean_proposed": drafted / rounds if rounds else None,
            "spec_fraction": rounds / steps if steps else 0.0,
            "tokens": per_run[0]["tokens"]}


def row(name: str, m: dict, plain_tok_s: float, k: int | None, c: float | None, v: dict) -> dict:
    """A configuration's figures; with ``c`` (its drafter's cost per drafted token, 0 for a lookup),
    the speedup a step costing only its forwards would give at the rounds it ran: ``ideal`` at
    independent acceptance, ``ideal_at_L`` at the accepted length measured. ``k`` is what it asked
    (None: the goodput policy chose); the model takes the mean proposal of its rounds either way."""
    speedup = m["tok_s"] / plain_tok_s
    out = {"config": name, "tok_s": m["tok_s"], "speedup": speedup, "alpha": m["alpha"],
           "mean_accepted": m["mean_accepted"], "spec_fraction": m["spec_fraction"], "k": k}
    if m["alpha"] is not None and c is not None:
        kbar = m["mean_proposed"]
        vk = verify_cost(v, kbar)
        f = m["spec_fraction"]
        ideal = ideal_speedup(iid_tokens(m["alpha"], kbar), kbar, c, vk, f)
        ideal_l = ideal_speedup(m["mean_accepted"] + 1, kbar, c, vk, f)
        out.update(c=c, v=vk, mean_proposed=kbar, ideal=ideal, ideal_at_L=ideal_l, efficiency=speedup / ideal_l)
    return out


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    paired = any("paired_speedup" in r for r in rows)
    print(f"{'config':<18}{'tok/s':>9}{'speedup':>9}" + (f"{'paired':>8}" if paired else "")
          + f"{'alpha':>8}{'acc/rnd':>9}{'spec%':>7}{'c':>7}{'v':>7}{'ideal':>8}{'ideal@L':>9}{'eff':>7}")

    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "-"
    for r in rows:
        print(f"{r['config']:<18}{r['tok_s']:>9.1f}{f(r['speedup'], '.2f'):>8}x"
              + (f"{f(r.get('paired_speedup'), '.2f'):>7}x" if paired else "")
              + f"{f(r['alpha'], '.3f'):>8}{f(r['mean_accepted'], '.2f'):>9}{f(100 * r['spec_fraction'], '.0f'):>7}"
              f"{f(r.get('c'), '.3f'):>7}{f(r.get('v'), '.2f'):>7}"
              f"{f(r.get('ideal'), '.2f'):>8}{f(r.get('ideal_at_L'), '.2f'):>9}{f(r.get('efficiency'), '.2f'):>7}")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    pair = Path(args.pair)
    target, tokenizer = load(str(pair / args.target_dir))
    draft, _ = load(str(pair / "draft"))
    ks = list(range(1, args.max_k + 1))
    costs = cost_model(target, draft, ks)
    c_draft = costs["c"]
    print(f"target step {costs['target_step_s'] * 1e3:.2f} ms, draft step {costs['draft_step_s'] * 1e3:.2f} ms, "
          f"c = {c_draft:.3f}; v(k) = " + ", ".join(f"{k}:{v:.2f}" for k, v in costs["v"].items()))
    heads = {Method.DRAFT: draft, **drafting_heads(args, target, pair / args.target_dir)}
    engine = Engine("bench", target, tokenizer, EngineConfig(max_batch_size=16), drafter=draft)
    engine.start()
    code = [tokenizer.encode(p) for p in CODE_PROMPTS]
    rewrite = [tokenizer.encode(p) for p in rewrite_prompts()]
    result: dict[str, Any] = {"costs": costs}
    try:
        # warm-up, at the concurrency sweep's k: a batch's attention layouts are timed at each verify
        # width the first time a step meets it (as in a daemon's first rounds); one row never weighs them
        await serve_clients(engine, [[p] for p in code[:2]], [SpeculationConfig(Method.DRAFT, args.conc_k)] * 2, 16)
        if not args.only_concurrency:
            await single_streams(engine, code, rewrite, ks, costs, c_draft, args, result)
        # 3. concurrency 1, 4, 8: spec on vs off, and the goodput default; c and v measured at that batch size
        prompts = (code + rewrite) * 2
        rows = []
        result["costs_by_batch"] = {}
        for conc in args.concurrency:
            bc = cost_model(target, draft, list(range(1, args.conc_k + 1)), batch=conc)
            result["costs_by_batch"][conc] = bc
            print(f"batch {conc}: target step {bc['target_step_s'] * 1e3:.2f} ms, c = {bc['c']:.3f}; v(k) = "
                  + ", ".join(f"{k}:{v:.2f}" for k, v in bc["v"].items()))
            k, c = args.conc_k, bc["c"]
            # name: (speculation, policy, drafter, the fixed k and the draft's cost c its ideal is modelled with);
            # each drafter as asked (k a ceiling) and under a SpecPolicy with the manifest's defaults
            # spec-off and n-gram run beside the draft model: a head that reads the target's features
            # would keep plain steps from starting before the previous one's tokens are read
            configs = {f"c={conc} off": (None, None, draft, None, None),
                       f"c={conc} ngram k={k}": (SpeculationConfig(Method.NGRAM, k), None, draft, k, 0.0)}
            for method, drafter in heads.items():
                # a DFlash drafter drafts its whole block in one forward: asked for all of it
                asked = drafter.block_size - 1 if method == Method.DFLASH else k
                configs[f"c={conc} {method} k={asked}"] = (SpeculationConfig(method, asked), None, drafter, asked,
                                                           c if method == Method.DRAFT else None)
                configs[f"c={conc} {method} goodput"] = (SpeculationConfig(method, asked), PolicySettings(),
                                                         drafter, None, c if method == Method.DRAFT else None)
            measured = await interleaved(engine, prompts[:max(conc, 8)], {n: v[:3] for n, v in configs.items()},
                                         args.max_tokens, args.runs, conc, args.learn_runs)
            base = measured[f"c={conc} off"]["tok_s"]
            for name, m in measured.items():
                rows.append({**row(name, m, base, *configs[name][3:], bc["v"]), "paired_speedup": m["paired"]})
        print_rows("concurrency sweep (speedup vs spec-off at the same concurrency; paired: the median "
                   "of each run's ratio to the spec-off run beside it)", rows)
        result["concurrency"] = rows
    finally:
        await engine.shutdown(1)
    return result


def drafting_heads(args: argparse.Namespace, target, target_dir: Path) -> dict[Method, Any]:
    """The heads the concurrency sweep runs beside the draft model: the MTP head the target's
    checkpoint ships (if it ships one), an EAGLE head from ``--eagle`` and a DFlash drafter from
    ``--dflash``."""
    heads: dict[Method, Any] = {}
    try:
        heads[Method.MTP] = load_mtp_head(str(target_dir), target)
    except NoMTPHead as exc:
        print(f"no MTP rows: {exc}")
    if args.eagle:
        heads[Method.EAGLE] = load_head(args.eagle, target)
    if args.dflash:
        heads[Method.DFLASH] = load_dflash(args.dflash, target)
    return heads


async def single_streams(engine: Engine, code: list[list[int]], rewrite: list[list[int]], ks: list[int],
                         costs: dict, c_draft: float, args: argparse.Namespace, result: dict) -> None:
    """Sections 1 and 2: one stream, every k."""
    # 1. single stream, code continuation: plain vs n-gram vs draft, k = 1..max_k
    plain = await measure(engine, code, None, args.max_tokens, args.runs, 1)
    rows = [row("plain", plain, plain["tok_s"], None, None, costs["v"])]
    for method, k in itertools.product((Method.NGRAM, Method.DRAFT), ks):
        m = await measure(engine, code, SpeculationConfig(method, k), args.max_tokens, args.runs, 1)
        rows.append(row(f"{method} k={k}", m, plain["tok_s"], k, c_draft if method == "draft" else 0.0, costs["v"]))
    print_rows("single stream, greedy, code continuation", rows)
    result["code_single_stream"] = rows
    # 2. single stream, repetitive rewrite task: plain vs n-gram
    plain_rw = await measure(engine, rewrite, None, args.max_tokens, args.runs, 1)
    rows = [row("plain", plain_rw, plain_rw["tok_s"], None, None, costs["v"])]
    for k in ks:
        m = await measure(engine, rewrite, SpeculationConfig(Method.NGRAM, k), args.max_tokens, args.runs, 1)
        rows.append(row(f"ngram k={k}", m, plain_rw["tok_s"], k, 0.0, costs["v"]))
    print_rows("single stream, greedy, rewrite task", rows)
    result["rewrite_single_stream"] = rows


def main() -> int:
    reuse_freed_memory()  # the C heap as the daemon sets it (specd/cli.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="models/demo")
    parser.add_argument("--target-dir", default="target", help="target model directory inside --pair")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-k", type=int, default=6)
    parser.add_argument("--conc-k", type=int, default=3)
    parser.add_argument("--learn-runs", type=int, default=0,
                        help="concurrency sweep: turns of every configuration run before the measured ones, "
                             "not measured (what goodput and the cost model learn is kept, as in a daemon that "
                             "has served a while)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--only-concurrency", action="store_true", help="skip the single-stream k sweeps")
    parser.add_argument("--eagle", default=None, help="an EAGLE head for the target, run beside the others")
    parser.add_argument("--dflash", default=None, help="a DFlash drafter for the target, run beside the others")
    parser.add_argument("--out", default=str(RESULTS / "spec_decode.json"))
    args = parser.parse_args()
    forge_json = Path(args.pair) / "forge.json"
    info = {**machine_info(args), "forge": json.loads(forge_json.read_text()) if forge_json.exists() else None}
    if not info["openblas_preloaded"] and platform.system() == "Linux":
        print("warning: OpenBLAS is not preloaded; run `source ops/env.sh` first")
    result = asyncio.run(bench(args))
    write_result(args.out, {**info, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
