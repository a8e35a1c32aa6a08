#!/usr/bin/env python3
"""Grammar engines on this CPU: llguidance against xgrammar, per-token mask cost and JSON-Schema coverage.

specd masks every verified position of a constrained row, so the cost that
matters is filling one token mask (and advancing the matcher) per row per
position.  For each engine, tokenizer and schema this walks a valid compact
document token by token with ``batch`` matchers in lockstep (1 and 16) and
times, per step, filling every row's mask and consuming the token:

* ``seq``: one row after another (what ``core.grammar.mask_logits`` does);
* ``par``: the engine's batched call (llguidance's ``fill_next_token_bitmask_par``
  on its thread pool, xgrammar's ``BatchGrammarMatcher``).

Tokenizers: the forge's test tokenizer (1,024 tokens) and a byte-level BPE
trained on the standard library as large as that corpus allows (about 40k
tokens of the 64k asked; real models have 128k to 200k, and mask cost grows
with the vocabulary; no hub here).  Coverage: for each schema keyword,
whether the engine refuses it, enforces it (rejects a document that breaks
only that keyword), or compiles it and accepts the violating document.

xgrammar is not a specd dependency (it pulls in torch); install it beside
specd to run this comparison (``pip install xgrammar``).

Usage (from the repository root)::

    python ops/bench/grammar_mask.py --runs 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from spec_decode import write_result  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "grammar_mask.json"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
PERSON_DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"], "ok": True}

ISSUE = {"type": "object", "$defs": {
    "user": {"type": "object", "properties": {"login": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,38}$"},
                                              "id": {"type": "integer", "minimum": 1}},
             "required": ["login", "id"], "additionalProperties": False}},
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 120},
        "state": {"enum": ["open", "closed"]},
        "number": {"type": "integer", "minimum": 1},
        "author": {"$ref": "#/$defs/user"},
        "assignees": {"type": "array", "items": {"$ref": "#/$defs/user"}, "maxItems": 4},
        "labels": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "color": {"type": "string", "pattern": "^[0-9a-f]{6}$"}},
            "required": ["name", "color"], "additionalProperties": False}},
        "milestone": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "title": {"type": "string"}, "due": {"type": "string", "format": "date"}},
            "required": ["title", "due"], "additionalProperties": False}]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["title", "state", "number", "author", "assignees", "labels", "milestone", "score"],
    "additionalProperties": False}
ISSUE_DOC = {"title": "Speculative decoding drops the last token under a stop string", "state": "open",
             "number": 1234, "author": {"login": "ada", "id": 7},
             "assignees": [{"login": "grace-h", "id": 11}, {"login": "alan", "id": 12}],
             "labels": [{"name": "bug", "color": "d73a4a"}, {"name": "engine", "color": "0e8a16"}],
             "milestone": {"title": "v0.4", "due": "2026-12-01"}, "score": 0.75}
SCHEMAS = {"person": (PERSON, PERSON_DOC), "issue": (ISSUE, ISSUE_DOC)}

FEATURES = {  # keyword -> (a schema using it, a compact document that violates only it)
    "enum/const": ({"type": "object", "properties": {"a": {"enum": [1, "x"]}, "b": {"const": 3}}}, '{"a":2}'),
    "string lengths": ({"type": "string", "minLength": 2, "maxLength": 5}, '"abcdefg"'),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}, '"AB-1"'),
    "format date-time": ({"type": "string", "format": "date-time"}, '"yesterday"'),
    "format email": ({"type": "string", "format": "email"}, '"nobody"'),
    "format uuid": ({"type": "string", "format": "uuid"}, '"1234"'),
    "integer range": ({"type": "integer", "minimum": -5, "exclusiveMaximum": 100}, "100"),
    "number range": ({"type": "number", "minimum": 0.5, "maximum": 2.5}, "3.5"),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "7"),
    "array lengths": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}, "[1,2,3,4]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
                    '[1,"a"]'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2,3]"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, '"x"'),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}, "{}"),
    "$ref/$defs": ({"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}, '["a"]'),
    "recursive $ref": ({"$defs": {"t": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "additionalProperties": False}},
        "$ref": "#/$defs/t"}, '{"kids":[{"kids":[1]}]}'),
    "additionalProperties schema": ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"a":"x"}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "string"}},
                           "additionalProperties": False}, '{"x_a":1}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"A1":1}'),
    "min/maxProperties": ({"type": "object", "minProperties": 1, "maxProperties": 2}, '{"a":1,"b":2,"c":3}'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    "if/then/else": ({"type": "object", "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
                      "then": {"required": ["b"]}}, '{"a":1}'),
    "not": ({"not": {"type": "string"}}, '"abc"'),
}


def forge_tokenizer(workdir: Path) -> Path:
    from specd.forge import forge

    out = workdir / "forge"
    forge(out, preset="test", seed=0, log=lambda *a, **k: None)
    return out / "target"


def large_tokenizer(workdir: Path, vocab: int) -> Path:
    """A byte-level BPE trained on the standard library, saved in the Hugging Face layout."""
    from specd.forge.tokenizer import save_tokenizer, stdlib_sources, train_tokenizer

    out = workdir / f"bpe{vocab}"
    save_tokenizer(train_tokenizer([text for _, text in stdlib_sources()], vocab), out)
    return out


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        self.vocab = len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        return self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})

    def matchers(self, grammar, n: int) -> list:
        out = [self.llg.LLMatcher(self.tokenizer, grammar) for _ in range(n)]
        if out[0].is_error():
            raise ValueError(out[0].get_error())
        return out

    def bitmask(self, n: int) -> np.ndarray:
        return self.np.allocate_token_bitmask(n, self.vocab)

    def fill_seq(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            self.np.fill_next_token_bitmask(m, bitmask, i)

    def fill_par(self, matchers, bitmask) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matchers, token: int) -> None:
        for m in matchers:
            m.consume_token(token)

    def supports(self, schema: dict, violation: str) -> str:
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except ValueError as e:
            return f"refused: {e}"[:120]
        failed, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            return ("refused: " + (messages[0] if messages else "invalid"))[:120]
        matcher = self.matchers(grammar, 1)[0]
        tokens = self.tokenizer.tokenize_str(violation)
        accepted = matcher.validate_tokens(tokens) == len(tokens) and (
            matcher.consume_tokens(tokens) and matcher.is_accepting())
        return "IGNORED (accepts a violating document)" if accepted else "enforced"


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.xgr = xgrammar
        self.vocab = len(tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, grammar, n: int) -> list:
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill_seq(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def fill_par(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matchers, token: int) -> None:
        for m in matchers:
            m.accept_token(token)

    def supports(self, schema: dict, violation: str) -> str:
        try:
            grammar = self.compile(schema)
        except Exception as e:  # xgrammar raises RuntimeError and its own types
            return f"refused: {e}"[:120]
        matcher = self.xgr.GrammarMatcher(grammar)
        accepted = matcher.accept_string(violation) and matcher.is_completed()
        return "IGNORED (accepts a violating document)" if accepted else "enforced"


def walk(engine, grammar, tokens: list[int], batch: int, mode: str) -> tuple[float, float]:
    """Seconds per step to fill ``batch`` masks, and to consume one token in each, over the document."""
    matchers = engine.matchers(grammar, batch)
    bitmask = engine.bitmask(batch)
    fill = engine.fill_par if mode == "par" else engine.fill_seq
    fill_s, consume_s = [], []
    for token in tokens:
        started = time.perf_counter()
        fill(matchers, bitmask)
        fill_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.consume(matchers, token)
        consume_s.append(time.perf_counter() - started)
    return statistics.mean(fill_s), statistics.mean(consume_s)


def measure(engine, tokenizer, runs: int) -> dict:
    out = {}
    for name, (schema, doc) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
        started = time.perf_counter()
        grammar = engine.compile(schema)
        compile_s = time.perf_counter() - started
        rows = {"compile_ms": round(compile_s * 1e3, 2), "doc_tokens": len(tokens)}
        for batch in (1, 16):
            for mode in ("seq", "par"):
                samples = [walk(engine, grammar, tokens, batch, mode) for _ in range(runs)]
                fill = statistics.median(s[0] for s in samples)
                consume = statistics.median(s[1] for s in samples)
                rows[f"b{batch}_{mode}"] = {"fill_us_per_step": round(fill * 1e6, 1),
                                            "fill_us_per_row": round(fill * 1e6 / batch, 1),
                                            "consume_us_per_step": round(consume * 1e6, 1)}
        out[name] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=65536, help="the large tokenizer's vocabulary")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    engines = [Llguidance]
    if importlib.util.find_spec("xgrammar") is not None:
        engines.append(Xgrammar)
    else:
        print("xgrammar is not installed: measuring llguidance alone")
    result: dict = {"runs": args.runs, "tokenizers": {}, "features": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"forge-test": forge_tokenizer(Path(tmp)), "stdlib-bpe": large_tokenizer(Path(tmp), args.vocab)}
        for name, path in paths.items():
            tokenizer = hf_tokenizer(path)
            label = f"{name}-{len(tokenizer)}"
            result["tokenizers"][label] = {"vocab": len(tokenizer), "engines": {}}
            for cls in engines:
                engine = cls(tokenizer)
                result["tokenizers"][label]["engines"][engine.name] = measure(engine, tokenizer, args.runs)
                if name == "stdlib-bpe":
                    result["features"][engine.name] = {k: engine.supports(*v) for k, v in FEATURES.items()}
    print_table(result)
    write_result(args.out, result)
    return 0


def print_table(result: dict) -> None:
    print(f"\nmask fill per step (µs, median of {result['runs']} walks); per row in brackets")
    for label, t in result["tokenizers"].items():
        for engine, schemas in t["engines"].items():
            for schema, rows in schemas.items():
                cells = [f"b{b} {m}: {rows[f'b{b}_{m}']['fill_us_per_step']:.0f} "
                         f"({rows[f'b{b}_{m}']['fill_us_per_row']:.0f})"
                         for b in (1, 16) for m in ("seq", "par")]
                print(f"  {label:18} {engine:10} {schema:6} compile {rows['compile_ms']:7.1f} ms | "
                      + " | ".join(cells))
    print("\nJSON-Schema keywords")
    names = list(result["features"])
    for feature in FEATURES:
        print(f"  {feature:28} " + " | ".join(f"{n}: {result['features'][n][feature][:60]}" for n in names))


if __name__ == "__main__":
    sys.exit(main())
