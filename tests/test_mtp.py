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

import asyncio
import itertools
import json
import shutil
from pathlib import Path

import pytest
from mlx_lm import load

from conftest import code_sample, run_engine, two_sample_chi2
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.engine.scheduler import RequestRejected
from specd.forge.mtp import WEIGHTS_FILE, fresh_head, save_mtp_head, train_mtp
from specd.speculation.mtp.checkpoint import NoMTPHead, load_mtp_head

GREEDY = SamplingParams(temperature=0)
MTP = SpeculationConfig("mtp", 3)
LONG = SpeculationConfig("mtp", 6)  # past the checkpoint's depth of 1: the head chained
NGRAM = SpeculationConfig("ngram", 3)
_ids = itertools.count()


@pytest.fixture(scope="module")
def trained(forged, tmp_path_factory) -> Path:
    """The forged test target with an MTP head trained against it (a few seconds)."""
    directory = tmp_path_factory.mktemp("mtp") / "target"
    shutil.copytree(forged / "target", directory)
    train_mtp(directory, steps=150, seq_len=64, batch=8, lr=3e-3, log=lambda line: None)
    return directory


def with_random_head(source: Path, directory: Path) -> Path:
    shutil.copytree(source, directory)
    model, _ = load(str(directory))
    save_mtp_head(fresh_head(model, seed=1), directory)
    return directory


async def generate(engine, prompt, spec=None, params=GREEDY, max_tokens=40, delay=0.0) -> list[int]:
    await asyncio.sleep(delay)
    request = GenerationRequest(f"m{next(_ids)}", prompt, params, max_tokens, (), spec)
    return [t async for out in engine.generate(request) for t in out.tokens]


def prompts_for(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(code_sample("eagle"))
    return [ids[i * 53: i * 53 + 10 + 5 * i] for i in range(6)] + [ids[20:36] * 3]


def parity(directory: Path) -> tuple[list, list, int, int]:
    """Plain outputs, and the same prompts served in a staggered mixed batch with the head loaded
    as a DraftPairing loads it; with the proposals drafted and accepted."""
    model, tokenizer = load(str(directory))
    head = load_mtp_head(str(directory), model)
    rows = prompts_for(tokenizer)

    async def both(engine):
        plain = await asyncio.gather(*(generate(engine, p) for p in rows))
        mixes = [MTP, LONG, None, NGRAM, MTP, LONG, MTP]
        sampled = SamplingParams(temperature=0.8, seed=5)
        mixed = await asyncio.gather(
            *(generate(engine, p, spec, delay=0.01 * (i % 3)) for i, (p, spec) in enumerate(zip(rows, mixes))),
            generate(engine, rows[2], MTP, sampled), generate(engine, rows[0], LONG, sampled))
        speculator = engine.scheduler.speculator
        return plain, mixed[: len(rows)], speculator.drafted_total, speculator.accepted_total

    return run_engine(model, tokenizer, both, draft_model=head, max_batch_size=16)


def test_a_trained_head_proposes_what_the_target_accepts_and_output_never_changes(trained):
    plain, mixed, drafted, accepted = parity(trained)
    assert all(len(p) == 40 for p in plain)
    assert mixed == plain
    assert 0 < accepted < drafted  # rounds kept some proposals and rolled the rest back
    info = json.loads((trained / "mtp-train.json").read_text())
    assert info["validation"]["top1_agreement"] > 0.2, info["validation"]


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_moe", "gemma3_text", "qwen3_next", "gpt_oss"])
def test_greedy_parity_for_each_family(family, family_models, tmp_path):
    """A random head of each family's own layer kind (MoE, sliding windows, a hybrid target whose
    cache rolls back by running again, attention sinks): whatever it proposes, the target decides."""
    plain, mixed, drafted, _ = parity(with_random_head(family_models(family), tmp_path / family))
    assert mixed == plain
    assert drafted > 0


def test_sampled_tokens_follow_the_target_with_mtp(trained):
    """Two-sample chi-square on the 2nd..4th generated tokens, MTP on against off."""
    model, tokenizer = load(str(trained))
    head = load_mtp_head(str(trained), model)
    prompt = prompts_for(tokenizer)[3]
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(300)]

    async def sample(engine, spec):
        outs = await asyncio.gather(*(generate(engine, prompt, spec, p, 4) for p in params))
        return [t for out in outs for t in out[1:]]

    off = run_engine(model, tokenizer, lambda e: sample(e, None), draft_model=head, max_batch_size=64,
                     max_waiting=1000)
    on = run_engine(model, tokenizer, lambda e: sample(e, MTP), draft_model=head, max_batch_size=64,
                    max_waiting=1000)
    stat, limit, dof = two_sample_chi2(off, on)
    assert stat < limit, (stat, limit, dof)


def test_checkpoints_without_a_head_are_refused_with_the_reason(forged, family_models, tmp_path):
    model, _ = load(str(forged / "target"))
    with pytest.raises(NoMTPHead, match="no num_nextn_predict_layers"):
        load_mtp_head(str(forged / "target"), model)
    # the config names a head the weights do not hold: a conversion dropped it
    dropped = with_random_head(forged / "target", tmp_path / "dropped")
    (dropped / WEIGHTS_FILE).unlink()
    with pytest.raises(NoMTPHead, match=r"holds no model\.layers\.4\.\* weights"):
        load_mtp_head(str(dropped), model)
    # Qwen3-Next's own layout is named, not mistaken for no head
    other = tmp_path / "qwen3_next"
    shutil.copytree(family_models("qwen3_next"), other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(NoMTPHead, match=r"mtp\.\* layout"):
        load_mtp_head(str(other), load(str(other))[0])
    # a hybrid whose last layer is recurrent has no attention layer to build the head as
    lfm2 = family_models("lfm2")
    with pytest.raises(NoMTPHead, match="not an attention layer"):
        load_mtp_head(str(with_random_head(lfm2, tmp_path / "lfm2")), load(str(lfm2))[0])
    # DeepSeek V3's latent attention runs row by row: its head cannot draft for a batch
    deepseek = family_models("deepseek_v3")
    config = json.loads((deepseek / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with pytest.raises(NoMTPHead, match="one by one"):
        load_mtp_head(str(deepseek), load(str(deepseek))[0])


def test_requests_asking_for_mtp_need_a_head(forged):
    model, tokenizer = load(str(forged / "target"))

    async def ask(engine):
        with pytest.raises(RequestRejected, match="no MTP head"):
            await generate(engine, [1, 2, 3], MTP)

    run_engine(model, tokenizer, ask)
