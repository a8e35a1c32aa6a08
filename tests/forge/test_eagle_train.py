"""Training EAGLE heads on the forged test target: the loss falls, and what is
saved loads back (load_head) as the very head that was trained."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from specd.forge.eagle import CHAIN_DEPTH, train_eagle
from specd.forge.tokenizer import stdlib_root
from specd.speculation.eagle.capture import FeatureCapture
from specd.speculation.eagle.checkpoint import load_head
from specd.core.model_parts import target_parts

CORPUS = ("textwrap.py", "shlex.py", "string.py")


@pytest.mark.parametrize("version", [1, 3])
def test_train_eagle_head(forged, tmp_path, version):
    out = tmp_path / "head"
    head, info = train_eagle(forged / "target", out, version=version,
                             corpus=[stdlib_root() / name for name in CORPUS], steps=30, seq_len=32,
                             batch=4, draft_vocab=256 if version == 3 else None, log=lambda _: None)

    curve = info["losses"]["every_10"]
    assert info["steps"] == 30 and len(curve) == 3
    assert curve[-1] < 0.8 * curve[0], curve
    val = info["validation"]
    assert 0.0 <= val["top1_agreement"] <= 1.0 and 0.0 <= val["mean_accepted"] <= CHAIN_DEPTH
    assert json.loads((out / "train.json").read_text()) == info
    if version == 3:
        assert head.config.draft_vocab_size == 256 and len(set(head.config.feature_layers)) == 3

    model, tokenizer = load(str(forged / "target"))
    loaded = load_head(out, model)
    assert loaded.config == head.config
    capture = FeatureCapture(model, head.config.feature_layers)
    tokens = mx.array([tokenizer.encode("def wrap(text, width=70):\n    return text")])
    model(tokens)
    embed, lm_head = target_parts(model)
    features = capture.take()[:, :-1]
    capture.remove()
    logits = [h.logits(h(h.fuse(features), embed(tokens[:, 1:])), lm_head) for h in (head, loaded)]
    np.testing.assert_array_equal(np.array(logits[0]), np.array(logits[1]))
