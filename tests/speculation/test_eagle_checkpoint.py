"""EAGLE checkpoints: synthetic heads with the published tensor names and
shapes (scaled to the forged target) load exactly, run like an independent
numpy reference, round-trip through save_head, and bad ones fail by name."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from specd.speculation.eagle.checkpoint import default_feature_layers, load_head, save_head
from specd.core.model_parts import target_parts

# The forged test target: hidden 64, 4 heads, 2 KV heads, 4 layers, vocab 1024.
H, HEADS, KV, D, VOCAB = 64, 4, 2, 16, 1024
INTER, DRAFT = 96, 48  # the head's own: differ from the target's so the config is what counts
THETA, EPS = 500000.0, 1e-6
N = 5  # positions per forward


@pytest.fixture(scope="module")
def target(forged):
    model, _ = load_model(forged / "target")
    return model


def _normal(rng: np.random.Generator, *shape: int, scale: float | None = None) -> np.ndarray:
    scale = shape[-1] ** -0.5 if scale is None else scale
    return (scale * rng.standard_normal(shape)).astype(np.float16)


def _norm(rng: np.random.Generator) -> np.ndarray:
    return (1 + 0.3 * rng.standard_normal(H)).astype(np.float16)


def _layer(rng: np.random.Generator, prefix: str, in_dims: int, fused: bool) -> dict[str, np.ndarray]:
    t = {
        "self_attn.q_proj.weight": _normal(rng, HEADS * D, in_dims),
        "self_attn.k_proj.weight": _normal(rng, KV * D, in_dims),
        "self_attn.v_proj.weight": _normal(rng, KV * D, in_dims),
        "self_attn.o_proj.weight": _normal(rng, H, HEADS * D),
        "mlp.gate_proj.weight": _normal(rng, INTER, H),
        "mlp.up_proj.weight": _normal(rng, INTER, H),
        "mlp.down_proj.weight": _normal(rng, H, INTER),
        "post_attention_layernorm.weight": _norm(rng),
    }
    if fused:
        t.update({"input_layernorm.weight": _norm(rng), "hidden_norm.weight": _norm(rng)})
    return {prefix + k: v for k, v in t.items()}


def _llama_config(architecture: str) -> dict:
    return {"architectures": [architecture], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "num_hidden_layers": 1, "rms_norm_eps": EPS, "rope_theta": THETA,
            "max_position_embeddings": 2048, "vocab_size": VOCAB, "tie_word_embeddings": False,
            "torch_dtype": "float16"}


def eagle1(seed: int = 1) -> tuple[dict, dict[str, np.ndarray]]:
    """SafeAILab EAGLE-1: an embedding copy, a biased fc, no layer-0 input norm."""
    rng = np.random.default_rng(seed)
    tensors = {"embed_tokens.weight": _normal(rng, VOCAB, H, scale=1.0),
               "fc.weight": _normal(rng, H, 2 * H), "fc.bias": _normal(rng, H, scale=0.1),
               **_layer(rng, "layers.0.", H, fused=False)}
    return {**_llama_config("LlamaForCausalLM"), "bias": True}, tensors


def eagle3(seed: int = 3, prefix: str = "midlayer.", draft: int = DRAFT) -> tuple[dict, dict[str, np.ndarray]]:
    """SpecForge EAGLE-3: a reduced draft vocabulary mapped by d2t/t2d."""
    rng = np.random.default_rng(seed)
    targets = np.sort(rng.choice(VOCAB, draft, replace=False))
    t2d = np.zeros(VOCAB, dtype=bool)
    t2d[targets] = True
    tensors = {"embed_tokens.weight": _normal(rng, VOCAB, H, scale=1.0), "fc.weight": _normal(rng, H, 3 * H),
               **_layer(rng, prefix, 2 * H, fused=True), "norm.weight": _norm(rng),
               "lm_head.weight": _normal(rng, draft, H), "d2t": targets - np.arange(draft), "t2d": t2d}
    config = {**_llama_config("LlamaForCausalLMEagle3"), "draft_vocab_size": draft,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 0, 1], "use_aux_hidden_state": True}}
    return config, tensors


def speculators_eagle3() -> tuple[dict, dict[str, np.ndarray]]:
    """The speculators format: nested layer config, ``layers.0``, layer *input* ids."""
    config, tensors = eagle3(prefix="layers.0.")
    layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size", "eagle_config")}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": DRAFT, "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}, tensors


def write(path: Path, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(tensors[k]) for k in names})
        return path
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        mx.save_safetensors(str(path / file), {k: mx.array(tensors[k]) for k in part})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# -- an independent reference ---------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rope(x: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE over (heads, N, D) at positions 0..N-1."""
    half = D // 2
    angles = np.arange(x.shape[1])[:, None] * THETA ** (-np.arange(0, D, 2) / D)[None]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _decoder(t: dict[str, np.ndarray], p: str, x: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """One Llama layer on (N, in) without its input norm, causal from position 0."""
    n = x.shape[0]

    def heads(name: str, count: int) -> np.ndarray:
        return (x @ t[p + name].T).reshape(n, count, D).transpose(1, 0, 2)

    q, k, v = _rope(heads("self_attn.q_proj.weight", HEADS)), _rope(heads("self_attn.k_proj.weight", KV)), \
        heads("self_attn.v_proj.weight", KV)
    k, v = np.repeat(k, HEADS // KV, axis=0), np.repeat(v, HEADS // KV, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(D) + np.triu(np.full((n, n), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    h = residual + (probs @ v).transpose(1, 0, 2).reshape(n, HEADS * D) @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(h, t[p + "post_attention_layernorm.weight"])
    gate = m @ t[p + "mlp.gate_proj.weight"].T
    return h + (gate / (1 + np.exp(-gate)) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T


def reference_eagle1(t: dict[str, np.ndarray], hidden: np.ndarray, embeds: np.ndarray) -> np.ndarray:
    x = np.concatenate([embeds, hidden], axis=-1) @ t["fc.weight"].T + t["fc.bias"]
    return _decoder(t, "layers.0.", x, x)


def reference_eagle3(t: dict[str, np.ndarray], features: np.ndarray, embeds: np.ndarray,
                     p: str = "midlayer.") -> tuple[np.ndarray, np.ndarray]:
    """The head's output and its draft-vocabulary logits."""
    hidden = features @ t["fc.weight"].T
    x = np.concatenate([_rms(embeds, t[p + "input_layernorm.weight"]), _rms(hidden, t[p + "hidden_norm.weight"])], -1)
    out = _decoder(t, p, x, hidden)
    return out, _rms(out, t["norm.weight"]) @ t["lm_head.weight"].T


def _f64(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in tensors.items()}


def _inputs(target, width: int, seed: int) -> tuple[mx.array, mx.array]:
    """Random target features and the target's embeddings of random tokens, (1, N, .)."""
    rng = np.random.default_rng(seed)
    features = mx.array(rng.standard_normal((1, N, width)).astype(np.float32))
    embed, _ = target_parts(target)
    return features, embed(mx.array(rng.integers(0, VOCAB, (1, N))))


def _params(head) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(head.parameters())}


# -- loading --------------------------------------------------------------------


@pytest.mark.parametrize("rope", ["rope_theta", "rope_parameters"])
def test_eagle1_loads_like_the_reference(tmp_path, target, rope):
    config, tensors = eagle1()
    if rope == "rope_parameters":  # transformers >= 5
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    head = load_head(write(tmp_path / "e1", config, tensors), target)
    c = head.config
    assert (c.version, c.fc_bias, c.intermediate_size, c.rope_theta, c.rms_norm_eps) == (1, True, INTER, THETA, EPS)
    params = _params(head)
    assert set(params) == set(tensors) - {"embed_tokens.weight"}
    for name, value in params.items():
        assert value.dtype == np.float32  # cast to the target's dtype
        np.testing.assert_array_equal(value, tensors[name].astype(np.float32), err_msg=name)
    hidden, embeds = _inputs(target, H, seed=10)
    out = np.array(head(hidden, embeds))[0]
    expected = reference_eagle1(_f64(tensors), np.array(hidden, np.float64)[0], np.array(embeds, np.float64)[0])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["specforge", "sharded", "speculators"])
def test_eagle3_loads_like_the_reference(tmp_path, target, layout):
    config, tensors = speculators_eagle3() if layout == "speculators" else eagle3()
    head = load_head(write(tmp_path / layout, config, tensors, shards=3 if layout == "sharded" else 1), target)
    c = head.config
    assert (c.version, c.draft_vocab_size, c.vocab_size, c.intermediate_size) == (3, DRAFT, VOCAB, INTER)
    assert c.feature_layers == (0, 1, 2)  # outputs of layers 0, 1, 2 however the config spells them
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    params = _params(head)
    assert set(params) == {n.replace(prefix, "midlayer.") for n in tensors} - {"embed_tokens.weight", "t2d"}
    for name, value in tensors.items():
        if name not in ("embed_tokens.weight", "t2d", "d2t"):
            np.testing.assert_array_equal(params[name.replace(prefix, "midlayer.")], value.astype(np.float32),
                                          err_msg=name)
    assert head.d2t.dtype == mx.int32
    np.testing.assert_array_equal(params["d2t"], tensors["d2t"])

    features, embeds = _inputs(target, 3 * H, seed=11)
    out = head(head.fuse(features), embeds)
    expected, draft_logits = reference_eagle3(_f64(tensors), np.array(features, np.float64)[0],
                                              np.array(embeds, np.float64)[0], prefix)
    np.testing.assert_allclose(np.array(out)[0], expected, rtol=1e-4, atol=1e-4)

    logits = np.array(head.logits(out, target_parts(target)[1]))[0]
    targets = np.arange(DRAFT) + tensors["d2t"]
    np.testing.assert_allclose(logits[:, targets], draft_logits, rtol=1e-4, atol=1e-4)
    assert np.all(np.isneginf(np.delete(logits, targets, axis=1)))


def test_eagle3_without_d2t_keeps_the_target_vocabulary(tmp_path, target):
    config, tensors = eagle3(draft=VOCAB)
    del tensors["d2t"], tensors["t2d"]
    head = load_head(write(tmp_path / "e3", config, tensors), target)
    np.testing.assert_array_equal(np.array(head.d2t), np.zeros(VOCAB, np.int32))


def test_default_feature_layers_follow_sglang(tmp_path, target):
    # Llama-3.1-8B: SGLang captures the inputs of layers 2, 16, 29.
    assert default_feature_layers(32) == (1, 15, 28)
    assert default_feature_layers(7) == (1, 2, 3)  # the smallest target with three distinct layers
    with pytest.raises(ValueError):
        default_feature_layers(6)
    config, tensors = eagle3()
    del config["eagle_config"]
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):  # 4 layers: no default
        load_head(write(tmp_path / "e3", config, tensors), target)


# -- saving ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [eagle1, eagle3])
def test_save_load_round_trip(tmp_path, target, forged, make):
    head = load_head(write(tmp_path / "in", *make()), target)
    target_config = json.loads((forged / "target" / "config.json").read_text())
    save_head(head, tmp_path / "out", target_config)

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    written = mx.load(str(tmp_path / "out" / "model.safetensors"))
    if head.config.version == 3:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert written["d2t"].dtype == mx.int64 and written["t2d"].dtype == mx.bool_
        assert np.array(written["t2d"]).sum() == DRAFT
    else:
        assert config["num_hidden_layers"] == 1 and config["bias"] is True
    assert config["eos_token_id"] == target_config["eos_token_id"]

    again = load_head(tmp_path / "out", target)
    assert again.config == head.config
    before, after = _params(head), _params(again)
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def test_save_refuses_features_out_of_layer_order(tmp_path, target):
    head = load_head(write(tmp_path / "in", *eagle3()), target)
    head.config.feature_layers = (2, 0, 1)
    with pytest.raises(ValueError, match="not in layer order"):
        save_head(head, tmp_path / "out")


# -- bad checkpoints --------------------------------------------------------------


def _set(key, value):
    def edit(config, tensors):
        config[key] = value
    return edit


def _drop(name):
    def edit(config, tensors):
        del tensors[name]
    return edit


def _add(name, value):
    def edit(config, tensors):
        tensors[name] = value
    return edit


def _shift_d2t(config, tensors):
    tensors["d2t"] = tensors["d2t"] + VOCAB


def _flip_t2d(config, tensors):
    tensors["t2d"] = ~tensors["t2d"]


BAD = {
    "hidden size": (eagle1, _set("hidden_size", 32), r"hidden_size 32, the target 64"),
    "vocab size": (eagle3, _set("vocab_size", 2048), r"vocab_size 2048, the target 1024"),
    "missing tensor": (eagle1, _drop("layers.0.mlp.up_proj.weight"), r"missing tensors \['layers.0.mlp.up_proj"),
    "unexpected tensor": (eagle1, _add("layers.0.input_layernorm.weight", np.ones(H, np.float16)),
                          r"unexpected tensors \['layers.0.input_layernorm.weight'\]"),
    "tensor shape": (eagle1, _add("fc.weight", np.zeros((H, 2 * H + 1), np.float16)),
                     r"fc.weight has shape \(64, 129\), expected \(64, 128\)"),
    "embedding shape": (eagle3, _add("embed_tokens.weight", np.zeros((VOCAB, 32), np.float16)),
                        r"embed_tokens.weight has shape \(1024, 32\), expected \(1024, 64\)"),
    "d2t range": (eagle3, _shift_d2t, r"d2t does not map"),
    "t2d": (eagle3, _flip_t2d, r"t2d disagrees with d2t"),
    "two layers": (eagle3, _set("num_hidden_layers", 2), r"num_hidden_layers = 2 is not supported"),
    "speculators norm_output": (speculators_eagle3, _set("norm_output", True), r"norm_output = True"),
    "feature layers": (eagle3, _set("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}),
                       r"feature layers \[0, 1, 4\]"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoints_say_what_is_wrong(tmp_path, target, case):
    make, edit, message = BAD[case]
    config, tensors = make()
    edit(config, tensors)
    with pytest.raises(ValueError, match=message):
        load_head(write(tmp_path / "bad", config, tensors), target)


def test_pytorch_bin_says_how_to_convert(tmp_path, target):
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(eagle1()[0]))
    (path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin(.|\n)*save_file"):
        load_head(path, target)
