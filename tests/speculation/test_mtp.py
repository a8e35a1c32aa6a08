"""MTP heads from the target's own checkpoint, inside continuous batching.

The forge writes heads in the nextn layout (``model.layers.{N}.*``) that
DeepSeek V3 and GLM-4.5 ship, and ``load_mtp_head`` reads them back as a
DraftPairing does. Greedy parity is the contract whatever the head proposes:
output is token-identical to the spec-off engine in staggered batches mixing
MTP, n-gram, sampled and plain rows, on the forged Llama target (with a head
trained against it, so rounds accept some proposals and roll the rest back)
and on tiny random models of the families whose layer kinds differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from drafters import (NGRAM, assert_refused_without_the_drafter, assert_sampling_follows_the_target, beside_the_engine,
                      mixed_batch_parity)
from specd.core.request import SpeculationConfig
from specd.forge.mtp import WEIGHTS_FILE, fresh_head, save_mtp_head, train_mtp
from specd.speculation.mtp.checkpoint import MIMO, NEXTN, QWEN3_NEXT, Layout, NoMTPHead, load_mtp_head

MTP = SpeculationConfig("mtp", 3)
LONG = SpeculationConfig("mtp", 6)  # past the checkpoint's depth of 1: the head chained


@pytest.fixture(scope="module")
def trained(forged, tmp_path_factory) -> Path:
    """The forged test target with an MTP head trained against it (a few seconds)."""
    directory = tmp_path_factory.mktemp("mtp") / "target"
    shutil.copytree(forged / "target", directory)
    train_mtp(directory, steps=150, seq_len=64, batch=8, lr=3e-3, log=lambda line: None)
    return directory


def with_random_head(source: Path, directory: Path, layout: Layout = NEXTN) -> Path:
    shutil.copytree(source, directory)
    model, _ = load(str(directory))
    save_mtp_head(fresh_head(model, seed=1), directory, layout)
    return directory


def parity(directory: Path) -> tuple[list, list, int, int]:
    """Plain outputs, and the same prompts served in a staggered mixed batch with the head loaded
    as a DraftPairing loads it; with the proposals drafted and accepted."""
    model, tokenizer = load(str(directory))
    return mixed_batch_parity(model, tokenizer, load_mtp_head(str(directory), model),
                              [MTP, LONG, None, NGRAM, MTP, LONG, MTP], [MTP, LONG])


def test_a_trained_head_proposes_what_the_target_accepts_and_output_never_changes(trained):
    plain, mixed, drafted, accepted = parity(trained)
    assert all(len(p) == 40 for p in plain)
    assert mixed == plain
    assert 0 < accepted < drafted  # rounds kept some proposals and rolled the rest back
    info = json.loads((trained / "mtp-train.json").read_text())
    assert info["validation"]["top1_agreement"] > 0.2, info["validation"]


@pytest.mark.parametrize("family, layout", [("glm4_moe", NEXTN), ("qwen3_moe", NEXTN), ("gemma3_text", NEXTN),
                                            ("qwen3_next", QWEN3_NEXT), ("qwen3_5_moe", QWEN3_NEXT), ("mimo", MIMO),
                                            ("lfm2", NEXTN), ("gpt_oss", NEXTN)])
def test_greedy_parity_for_each_family(family, layout, family_models, tmp_path):
    """A random head of each family's own attention layer kind (MoE, sliding windows, hybrid targets
    whose cache rolls back by running again, attention sinks), in GLM's nextn layout or Qwen3-Next's
    mtp.* one: whatever it proposes, the target decides."""
    plain, mixed, drafted, _ = parity(with_random_head(family_models(family), tmp_path / family, layout))
    assert mixed == plain
    assert drafted > 0


def test_mtp_rows_under_a_grammar_with_penalties_and_a_warm_prefix_cache_write_what_plain_rows_write(trained):
    """MTP beside the rest of the engine (``beside_the_engine``). Quantized keys and values:
    ``test_kv_quantization``."""
    model, tokenizer = load(str(trained))
    plain, speculated, drafted = beside_the_engine(model, tokenizer, load_mtp_head(str(trained), model), MTP)
    assert speculated == plain and plain[0] == plain[1]
    assert drafted > 0
    assert tokenizer.decode(plain[0][2]).startswith('{"n"')  # the grammar's row writes its object


def test_a_qwen3_next_head_reads_the_same_from_its_published_layout(family_models, tmp_path):
    """Qwen3-Next publishes its head as mtp.* with its experts one by one and its norms
    zero-centred (1 + w): read through the family's own sanitize, it is the head the MLX layout
    (experts stacked, norms as used) holds."""
    source = family_models("qwen3_next")
    model, _ = load(str(source))
    mlx_layout, published = tmp_path / "mlx", tmp_path / "published"
    for directory in (mlx_layout, published):
        shutil.copytree(source, directory)
    save_mtp_head(fresh_head(model, seed=2), mlx_layout, QWEN3_NEXT)
    for written in ("config.json", "model.safetensors.index.json"):  # the head named in both
        if (mlx_layout / written).exists():
            shutil.copy(mlx_layout / written, published / written)
    tensors = {}
    for name, array in mx.load(str(mlx_layout / WEIGHTS_FILE)).items():
        if ".switch_mlp." in name:
            tensors.update({name.replace("switch_mlp.", f"experts.{e}."): array[e] for e in range(array.shape[0])})
        else:
            tensors[name] = array - 1 if array.ndim == 1 and "norm" in name else array
    mx.save_safetensors(str(published / WEIGHTS_FILE), tensors)
    ours, theirs = (dict(tree_flatten(load_mtp_head(str(d), model).parameters())) for d in (mlx_layout, published))
    assert ours.keys() == theirs.keys()
    assert all(mx.allclose(ours[k], theirs[k], atol=1e-6).item() for k in ours)


def test_sampled_tokens_follow_the_target_with_mtp(trained):
    model, tokenizer = load(str(trained))
    assert_sampling_follows_the_target(model, tokenizer, load_mtp_head(str(trained), model), MTP)


def test_checkpoints_without_a_head_are_refused_with_the_reason(forged, family_models, tmp_path):
    model, _ = load(str(forged / "target"))
    with pytest.raises(NoMTPHead, match="no num_nextn_predict_layers"):
        load_mtp_head(str(forged / "target"), model)
    # the config names a head the weights do not hold: a conversion dropped it
    dropped = with_random_head(forged / "target", tmp_path / "dropped")
    (dropped / WEIGHTS_FILE).unlink()
    with pytest.raises(NoMTPHead, match=r"holds no model\.layers\.4\.\* or model\.mtp_layers\.0\.\* weights"):
        load_mtp_head(str(dropped), model)
    # a family whose every layer mixes attention with a state space model has no layer to build the head as
    falcon = tmp_path / "falcon_h1"
    shutil.copytree(family_models("falcon_h1"), falcon)
    config = json.loads((falcon / "config.json").read_text())
    (falcon / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(NoMTPHead, match="attention alone"):
        load_mtp_head(str(falcon), load(str(falcon))[0])
    # DeepSeek V3's latent attention runs row by row: its head cannot draft for a batch
    deepseek = family_models("deepseek_v3")
    config = json.loads((deepseek / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with pytest.raises(NoMTPHead, match="one by one"):
        load_mtp_head(str(deepseek), load(str(deepseek))[0])


def test_requests_asking_for_mtp_need_a_head(forged):
    assert_refused_without_the_drafter(*load(str(forged / "target")), MTP, "no MTP head")
