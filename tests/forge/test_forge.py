"""The model forge's test preset: deterministic, mlx_lm-loadable, usable for decoding."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load
from mlx_lm.models.cache import make_prompt_cache

from specd.forge import add_arguments, forge, run

TEXTS = [
    "def f(x):\n    return x + 1\n",
    " leading space, trailing spaces   \n\n\ttab\n",
    "class A:\n\n    pass\n\n\n# comment with unicode: é ü 漢字 🙂\n",
    "a ,b",
    "\n",
    "x<|im_end|>y",
]


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return forge(tmp_path_factory.mktemp("forge") / "pair", preset="test", seed=0, log=lambda _: None)


@pytest.fixture(scope="module")
def target(pair: dict):
    return load(pair["target_path"])


def test_layout(pair: dict) -> None:
    root = Path(pair["out_dir"])
    for name in ("target", "draft"):
        files = {p.name for p in (root / name).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
        config = json.loads((root / name / "config.json").read_text())
        assert config["model_type"] == "llama"
        assert config["max_position_embeddings"] == 2048
    # One tokenizer for both models.
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (root / "target" / f).read_bytes() == (root / "draft" / f).read_bytes()
    manifest = json.loads((root / "forge.json").read_text())
    assert manifest["recipe_hash"] == pair["recipe_hash"]
    assert manifest["target"]["params"] > manifest["draft"]["params"] > 0


def test_the_agent_model_is_the_target_with_tools_and_a_wide_window(pair: dict) -> None:
    """``agent``: the target's weights, a template that renders tools, a window for an agent client's prompt."""
    root = Path(pair["agent_path"])
    assert (root / "model.safetensors").read_bytes() == (Path(pair["target_path"]) / "model.safetensors").read_bytes()
    assert json.loads((root / "config.json").read_text())["max_position_embeddings"] == 65536
    model, tokenizer = load(str(root))
    tool = {"type": "function", "function": {"name": "list_files", "description": "Lists files.",
                                             "parameters": {"type": "object", "properties": {}}}}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool], tokenize=False)
    assert "<tools>" in text and "list_files" in text


def test_deterministic_cached_and_forced(pair: dict, tmp_path: Path) -> None:
    logs: list[str] = []
    again = forge(tmp_path / "again", preset="test", seed=0, log=logs.append)
    assert _digests(Path(again["out_dir"])) == _digests(Path(pair["out_dir"]))

    weights = tmp_path / "again" / "target" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    cached = forge(tmp_path / "again", preset="test", seed=0, log=logs.append)
    assert "reusing" in logs[-1] and weights.stat().st_mtime_ns == stamp
    assert cached["recipe_hash"] == again["recipe_hash"]

    forge(tmp_path / "again", preset="test", seed=0, log=logs.append, force=True)
    assert "reusing" not in logs[-1]
    assert _digests(tmp_path / "again") == _digests(Path(pair["out_dir"]))
    assert not list((tmp_path / "again").glob(".forge-tmp-*"))

    # Another seed into the same directory replaces the pair; the tokenizer stays.
    forge(tmp_path / "again", preset="test", seed=1, log=logs.append)
    a, b = _digests(tmp_path / "again"), _digests(Path(pair["out_dir"]))
    assert a["target/tokenizer.json"] == b["target/tokenizer.json"]
    assert a["target/model.safetensors"] != b["target/model.safetensors"]


def test_load_float32(target) -> None:
    model, _ = target
    from mlx.utils import tree_flatten

    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))


def test_chat_template_and_eos(target) -> None:
    _, tok = target
    assert tok.has_chat_template
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert ids[0] == im_start and ids.count(im_end) == 2
    assert tok.eos_token_ids == {eos, im_end}
    assert tok.eos_token_id == eos and tok.pad_token_id == eos
    assert tok.bos_token is None


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_streaming(target, text: str) -> None:
    _, tok = target
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer
    detok.reset()
    streamed = ""
    for i in ids:
        detok.add_token(i)
        streamed += detok.last_segment
    detok.finalize()
    streamed += detok.last_segment
    assert streamed == text


def test_greedy_generation_varied(target) -> None:
    model, tok = target
    out = generate(model, tok, "def main():\n", max_tokens=32)
    ids = tok.encode(out)
    assert len(ids) >= 16
    assert len(set(ids)) >= 8  # a random model, but not stuck on one token


def test_greedy_margins_and_batch_consistency(target) -> None:
    """Top-1 logit gaps are far above float noise, so batched and one-by-one
    decoding (different kernels, different rounding) pick the same tokens."""
    model, _ = target
    rng = np.random.default_rng(0)
    prompts = mx.array(rng.integers(3, 1024, size=(4, 12)))
    full = model(prompts)  # all positions of 4 sequences at once
    gaps = []
    for b in range(4):
        cache = make_prompt_cache(model)
        for t in range(12):
            step = model(prompts[b : b + 1, t : t + 1], cache=cache)[0, -1]
            assert mx.argmax(step).item() == mx.argmax(full[b, t]).item()
            top2 = mx.sort(step)[-2:]
            gaps.append((top2[1] - top2[0]).item())
    assert np.mean(np.array(gaps) < 1e-4) == 0
    assert np.median(gaps) > 0.1


def test_draft_agrees_partially(pair: dict) -> None:
    # Speculative decoding tests need both accepted and rejected proposals.
    assert 0.3 < pair["agreement_top1"] < 0.9


def test_cli_helpers(pair: dict, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([pair["out_dir"], "--preset", "test", "--seed", "0"])
    assert args.out_dir == Path(pair["out_dir"]) and args.seed == 0 and not args.force
    assert run(args) == 0  # reuses the fixture's pair
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["target_path"] == pair["target_path"]
    assert parser.parse_args(["x", "--force"]).force
    with pytest.raises(SystemExit):
        parser.parse_args(["x", "--preset", "huge"])
