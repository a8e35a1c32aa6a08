"""Images in a prompt: a vision-language checkpoint's vision tower and projector, read by mlx-vlm.

The engine runs the checkpoint's language model as it runs any mlx-lm model (its text half, as
``mlx_lm.load`` reads it: continuous batching, per-row caches, speculation, grammars). Only a
prefill chunk that covers a prompt's image tokens differs: it takes its input embeddings from
mlx-vlm's ``get_input_embeddings`` (the image features scattered over the text embeddings),
computed on the engine thread when the row's first such chunk runs. mlx-vlm's copy of the
language model keeps none of its own layers: its token embedding is the engine's.

A prompt's image tokens all have one id; the prefix cache keys them by the image's pixels
instead (``PromptImages.keys``), so a conversation that resends a screenshot hits the cache
and its vision features are not computed again, and another image never matches.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .loader import with_text_config
from .model_parts import decoder

# Prefix-cache keys of image tokens: above any vocabulary, below 2**31 (tokens are int32 there).
IMAGE_KEY_BASE = 1 << 30


class VisionUnavailable(Exception):
    """Why a Model cannot take images (its ``status.modalities`` says so)."""


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images as the checkpoint's processor made them."""

    pixel_values: mx.array
    inputs: dict  # the processor's other per-image inputs (Qwen's image_grid_thw, ...)
    digests: tuple[str, ...]  # each image's pixels, hashed (sha256 of mode, size and bytes)
    token_id: int  # the id of the prompt's image tokens

    def keys(self, prompt: list[int]) -> list[int]:
        """``prompt`` with each image's tokens replaced by a key of its pixels (the prefix
        cache's view). The k-th run of image tokens is the k-th image's; a prompt whose runs
        do not pair with its images (a processor that splits one) keys every run by them all."""
        ids = np.asarray(prompt)
        image = ids == self.token_id
        starts = np.flatnonzero(image & ~np.concatenate([[False], image[:-1]]))
        ends = np.flatnonzero(image & ~np.concatenate([image[1:], [False]])) + 1
        if len(starts) == len(self.digests):
            digests = self.digests
        else:
            digests = (hashlib.sha256("".join(self.digests).encode()).hexdigest(),) * len(starts)
        keyed = ids.copy()
        for start, end, digest in zip(starts, ends, digests):
            keyed[start:end] = IMAGE_KEY_BASE + int(digest[:8], 16) % IMAGE_KEY_BASE
        return keyed.tolist()


def pixel_digest(image) -> str:
    """A decoded PIL image's identity: its mode, size and pixels."""
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


# What mlx-vlm's processors pass on to the tokenizer, which some (its LLaVA's) also pass to the
# image processor, which transformers 5 refuses for them (mlx-vlm issue #870, fixed only for PaliGemma).
TOKENIZER_KWARGS = frozenset({"padding", "padding_side", "add_special_tokens", "truncation", "max_length"})


def without_text_kwargs(processor) -> None:
    """Make ``processor``'s image processor ignore the tokenizer's keyword arguments."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return
    base = type(image_processor)

    class ImageKwargsOnly(base):
        def __call__(self, images, *args, **kwargs):
            return base.__call__(self, images, *args, **{k: v for k, v in kwargs.items() if k not in TOKENIZER_KWARGS})

    ImageKwargsOnly.__name__ = ImageKwargsOnly.__qualname__ = base.__name__
    image_processor.__class__ = ImageKwargsOnly


def takes_images(path: Path) -> bool:
    """Whether a checkpoint directory is a vision-language one (its config has a vision tower)."""
    config = json.loads((path / "config.json").read_text())
    return isinstance(config.get("vision_config"), dict)


class VisionTower:
    """A checkpoint's vision tower, projector and processor (mlx-vlm), beside its text model."""

    def __init__(self, path: Path, text_model: nn.Module):
        try:
            from mlx_vlm.utils import load_model, load_processor, should_add_special_tokens
        except ImportError as e:
            raise VisionUnavailable(f"images need mlx-vlm (pip install 'specd[vision]'): {e}") from None
        if "input_embeddings" not in inspect.signature(text_model.__call__).parameters:
            raise VisionUnavailable(f"mlx-lm's {type(text_model).__module__} takes no input embeddings")
        config = with_text_config(json.loads((path / "config.json").read_text()))
        if "mrope_section" in (config.get("rope_scaling") or config.get("rope_parameters") or {}):
            raise VisionUnavailable("its image tokens take multimodal rotary positions (Qwen-VL's mrope), "
                                    "which specd's engine does not run yet")
        model = load_model(path, lazy=True)
        language = model.language_model
        language.model.embed_tokens = decoder(text_model).embed_tokens  # the engine's own
        language.model.layers = []  # the engine's text model runs the layers
        if hasattr(language, "lm_head"):
            language.lm_head = None
        mx.eval(model.parameters())
        self.model = model
        config = model.config
        self.token_id = next(int(v) for v in (getattr(config, "image_token_id", None),
                                              getattr(config, "image_token_index", None)) if v is not None)
        self.processor = load_processor(path, add_detokenizer=False)
        without_text_kwargs(self.processor)
        self._special_tokens = should_add_special_tokens(config.model_type, self.processor)
        shared = sum(v.nbytes for _, v in tree_flatten(language.model.embed_tokens.parameters()))
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - shared  # tower, projector

    def prepare(self, text: str, images: list, digests: tuple[str, ...]) -> tuple[list[int], PromptImages]:
        """A rendered prompt and its images through the processor (CPU work, any thread): the
        prompt's token ids, each image's tokens expanded, and its pixel values."""
        from mlx_vlm.utils import prepare_inputs

        inputs = prepare_inputs(self.processor, images=images, prompts=text, image_token_index=self.token_id,
                                add_special_tokens=self._special_tokens)
        prompt = inputs.pop("input_ids")[0].tolist()
        pixel_values = inputs.pop("pixel_values")
        inputs.pop("attention_mask", None)
        mx.eval(pixel_values, inputs)  # made on this thread's stream: the engine thread reads them
        return prompt, PromptImages(pixel_values, inputs, digests, self.token_id)

    def embeddings(self, prompt: list[int], images: PromptImages) -> mx.array:
        """(len(prompt), hidden): the prompt's input embeddings, image features in place (engine thread)."""
        ids = mx.array([prompt])
        features = self.model.get_input_embeddings(ids, images.pixel_values, mask=mx.ones_like(ids), **images.inputs)
        return features.inputs_embeds[0]

    def chunk(self, embed: nn.Module, tokens: mx.array, rows: list[tuple[mx.array | None, int]]) -> mx.array:
        """(B, width, hidden) input embeddings of a prefill chunk's ``tokens``: row b's text
        embedded, and where ``rows[b]`` = (its prompt's embeddings, the prompt position of the
        chunk's first column) covers it, the prompt's embeddings instead."""
        text = embed(tokens)
        width = tokens.shape[1]
        out = []
        for b, (prompt, first) in enumerate(rows):
            lo, hi = max(first, 0), min(first + width, 0 if prompt is None else prompt.shape[0])
            if prompt is None or lo >= hi:
                out.append(text[b])
                continue
            out.append(mx.concatenate([text[b, :lo - first], prompt[lo:hi].astype(text.dtype), text[b, hi - first:]]))
        return mx.stack(out)
