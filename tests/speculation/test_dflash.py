"""DFlash block drafters, in z-lab's published layout, inside continuous batching.

``specd.forge.dflash`` writes drafters as z-lab publishes them and
``load_dflash`` reads them back as a DraftPairing does. Greedy parity is the
contract whatever the drafter proposes: output is token-identical to the
spec-off engine in staggered batches mixing DFlash chains and block trees
with n-gram, sampled and plain rows, on the forged Llama target (with a
drafter trained against it, so rounds accept some proposals and roll the
rest back) and on tiny random models of the families published drafters
serve (Qwen3, Qwen3 MoE for Qwen3-Coder, Llama, gpt-oss) and of those whose
caches differ (sliding windows, a hybrid target that drafts chains only).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from conftest import counting_steps_run_ahead, measure_plain_decoding_best, run_engine
from drafters import (NGRAM, assert_refused_without_the_drafter, assert_sampling_follows_the_target, beside_the_engine,
                      generate, mixed_batch_parity, prompts_for)
from specd.core.request import SpeculationConfig
from specd.forge.dflash import fresh_drafter, train_dflash
from specd.speculation.costs import CostModel
from specd.speculation.dflash.checkpoint import load_dflash, save_dflash
from specd.speculation.dflash.proposer import DFlashProposer
from specd.speculation.eagle.capture import FeatureCapture

CHAIN = SpeculationConfig("dflash", 7)
TREE = SpeculationConfig("dflash", 5, tree_top_k=3, tree_tokens=12)
LONG = SpeculationConfig("dflash", 12)  # past the block: drafts block_size - 1


@pytest.fixture(scope="module")
def trained(forged, tmp_path_factory) -> Path:
    """A drafter trained against the forged test target (a few seconds)."""
    out = tmp_path_factory.mktemp("dflash") / "drafter"
    train_dflash(forged / "target", out, steps=120, seq_len=64, batch=8, lr=3e-3, log=lambda line: None)
    return out


def with_random_drafter(target: Path, out: Path, seed: int = 1) -> Path:
    model, _ = load(str(target))
    config = json.loads((target / "config.json").read_text())
    save_dflash(fresh_drafter(model, seed=seed, config=config), out, config)
    return out


def parity(target: Path, drafter: Path) -> tuple[list, list, int, int]:
    """Plain outputs, and the same prompts served in a staggered mixed batch with the drafter loaded
    as a DraftPairing loads it; with the proposals drafted and accepted."""
    model, tokenizer = load(str(target))
    return mixed_batch_parity(model, tokenizer, load_dflash(str(drafter), model),
                              [CHAIN, TREE, None, NGRAM, LONG, TREE, CHAIN], [CHAIN, TREE])


def test_a_trained_drafter_proposes_what_the_target_accepts_and_output_never_changes(forged, trained):
    plain, mixed, drafted, accepted = parity(forged / "target", trained)
    assert all(len(p) == 40 for p in plain)
    assert mixed == plain
    assert 0 < accepted < drafted  # rounds kept some proposals and rolled the rest back
    info = json.loads((trained / "train.json").read_text())
    assert info["losses"]["final"] < info["losses"]["first"], info["losses"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama", "gpt_oss", "gemma3_text", "qwen3_next"])
def test_greedy_parity_for_each_family(family, family_models, tmp_path):
    """A random drafter reading three of each family's layers: whatever it proposes, the target
    decides (sliding windows, attention sinks, MoE; Qwen3-Next's recurrent layers draft chains)."""
    target = family_models(family)
    plain, mixed, drafted, _ = parity(target, with_random_drafter(target, tmp_path / "drafter"))
    assert mixed == plain
    assert drafted > 0


def test_dflash_rows_under_a_grammar_with_penalties_and_a_warm_prefix_cache_write_what_plain_rows_write(
        forged, trained):
    """DFlash trees beside the rest of the engine (``beside_the_engine``): served twice, the second
    time the drafter's context entries come from the prefix cache too."""
    model, tokenizer = load(str(forged / "target"))
    plain, speculated, drafted = beside_the_engine(model, tokenizer, load_dflash(str(trained), model), TREE)
    assert speculated == plain and plain[0] == plain[1]
    assert drafted > 0
    assert tokenizer.decode(plain[0][2]).startswith('{"n"')


def test_rows_decoding_plainly_run_ahead_and_the_drafter_still_reads_each_step_s_own_features(forged, trained):
    """DFlash rows under a goodput policy that measured plain decoding best start each step before
    the last one's tokens are read, as spec-off rows do; the drafter's context is still exactly
    the target's features of each position, as one forward over the whole context gives them."""
    model, tokenizer = load(str(forged / "target"))
    drafter = load_dflash(str(trained), model)
    queued = {}
    release = DFlashProposer.release

    def keep(self, seqs):  # on the engine thread, whose stream the features are on: evaluated here
        queued.update({tuple(s.prompt + s.tokens): mx.concatenate(self.queued[s]) for s in seqs if self.queued.get(s)})
        mx.eval(list(queued.values()))
        release(self, seqs)

    async def go(engine):
        await measure_plain_decoding_best(engine)
        return await asyncio.gather(*(generate(engine, p, CHAIN, max_tokens=24) for p in prompts_for(tokenizer)[:4]))

    with counting_steps_run_ahead() as taken, mock.patch.object(DFlashProposer, "release", keep):
        run_engine(model, tokenizer, go, draft_model=drafter, max_batch_size=8)
    assert taken[0] > 10, taken
    assert len(queued) == 4
    capture = FeatureCapture(model, drafter.feature_layers)
    try:
        for context, features in queued.items():
            model(mx.array([context[: features.shape[0]]]))
            expected = drafter.fuse(capture.take())[0]
            assert features.shape[0] == len(context) - 1  # every position but the last token's
            assert mx.allclose(features, expected, atol=1e-4).item()
    finally:
        capture.remove()


def test_sampled_tokens_follow_the_target_with_dflash(forged, trained):
    model, tokenizer = load(str(forged / "target"))
    assert_sampling_follows_the_target(model, tokenizer, load_dflash(str(trained), model), CHAIN)


def test_a_drafter_written_is_read_back_and_z_labs_config_keys_are_read(forged, tmp_path):
    """What the forge writes loads to the same weights; a config in z-lab's published form (block
    size at the top, ids under dflash_config, rope under rope_parameters) reads the same."""
    model, _ = load(str(forged / "target"))
    written = with_random_drafter(forged / "target", tmp_path / "ours")
    config = json.loads((written / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    published = tmp_path / "published"
    shutil.copytree(written, published)
    theta = config.pop("rope_theta")
    config.update(rope_parameters={"rope_theta": theta, "rope_type": "default"}, num_target_layers=None)
    (published / "config.json").write_text(json.dumps(config))
    ours, theirs = (load_dflash(str(d), model) for d in (written, published))
    assert ours.config == theirs.config
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("edit, reason", [
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64), "sliding"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), "target_layer_ids"),
    (lambda c: c.update(hidden_size=32), "hidden_size"),
    (lambda c: c.update(num_target_layers=36), "36-layer target"),
    (lambda c: c["dflash_config"].update(mask_token_id=10**6), "mask_token_id"),
    (lambda c: c["dflash_config"].update(output_multiplier=0.5), "output_multiplier"),
    (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids and mask_token_id"),
])
def test_drafters_that_do_not_fit_the_target_are_refused_with_the_reason(forged, tmp_path, edit, reason):
    model, _ = load(str(forged / "target"))
    drafter = with_random_drafter(forged / "target", tmp_path / "drafter")
    config = json.loads((drafter / "config.json").read_text())
    edit(config)
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=reason):
        load_dflash(str(drafter), model)


def test_missing_tensors_are_named(forged, tmp_path):
    model, _ = load(str(forged / "target"))
    drafter = with_random_drafter(forged / "target", tmp_path / "drafter")
    tensors = mx.load(str(drafter / "model.safetensors"))
    del tensors["fc.weight"]
    mx.save_safetensors(str(drafter / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match=r"missing tensors \['fc.weight'\]"):
        load_dflash(str(drafter), model)


def test_requests_asking_for_dflash_need_a_drafter(forged):
    assert_refused_without_the_drafter(*load(str(forged / "target")), CHAIN, "no DFlash drafter")


def test_a_block_drafter_costs_one_forward_whatever_it_drafts():
    costs = CostModel()
    costs.observe_draft(4, 1, 0.01)
    plain = costs.draft_seconds(4, 5)
    costs.block_drafts = True
    assert costs.draft_seconds(4, 5) == pytest.approx(plain / 5)
    assert costs.draft_seconds(4, 0) == 0.0
    assert costs.draft_row_seconds(7) == costs.draft_row_seconds(1)
