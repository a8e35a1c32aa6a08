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

Qwen2-VL and Qwen2.5-VL place an image's tokens at (t, h, w) positions and the text after it at
its index plus a delta (mrope). The text model rotates by one offset per row, so each of its
RoPE modules is wrapped (``MultimodalPositions``): a prefill chunk that holds a row with images
rotates every token at its own three positions, each frequency by its section's; a row's later
tokens are rotated by its offset moved on by the delta (``RowCache.shift``), which draft trees
and rollback see as any offset.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .loader import materialize, with_text_config
from .model_parts import decoder, rotate_at

# Prefix-cache keys of image tokens: above any vocabulary, below 2**31 (tokens are int32 there).
IMAGE_KEY_BASE = 1 << 30
# Families whose images take multimodal rotary positions alone (Qwen3-VL also adds deepstack features)
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


class VisionUnavailable(Exception):
    """Why a Model cannot take images (its ``status.modalities`` says so)."""


class ImagesNotInPrompt(ValueError):
    """The request's images have no place in its prompt (the chat template rendered none, or the
    processor refused the pairing): never served as if no image had been sent."""


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images as the checkpoint's processor made them."""

    pixel_values: mx.array
    inputs: dict  # the processor's other per-image inputs (Qwen's image_grid_thw, ...)
    digests: tuple[str, ...]  # each image's pixels, hashed (sha256 of mode, size and bytes)
    token_id: int  # the id of the prompt's image tokens
    positions: mx.array | None = None  # (3, prompt length): Qwen-VL's (t, h, w) position of each token
    rope_delta: int = 0  # where a token after the prompt sits: its index plus this

    def positions_at(self, first: int, width: int) -> mx.array:
        """(3, width) positions of prompt positions ``first`` on (before the prompt: the index;
        past it: the index plus ``rope_delta``)."""
        index = mx.arange(first, first + width)
        plain = mx.broadcast_to(mx.where(index >= 0, index + self.rope_delta, index), (3, width))
        length = self.positions.shape[1]
        lo, hi = max(first, 0), min(first + width, length)
        if lo >= hi:
            return plain
        return mx.concatenate([plain[:, :lo - first], self.positions[:, lo:hi], plain[:, hi - first:]], axis=1)

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


class MultimodalPositions:
    """Qwen-VL's rotary positions over a text model that rotates by one offset per row: each
    layer's RoPE module wrapped, rotating each token at its (t, h, w) positions while
    ``positions`` (3, B, L) is set (``at``), each frequency by its ``mrope_section``'s."""

    def __init__(self, model: nn.Module, sections: list[int]):
        self.positions: mx.array | None = None
        layers = decoder(model).layers
        dims = layers[0].self_attn.rope.dims
        head_dim = layers[0].self_attn.q_proj.weight.shape[0] // layers[0].self_attn.n_heads
        half = dims // 2
        bounds = np.cumsum(sections)
        owner = np.array([int(np.searchsorted(bounds, j % half, side="right")) if j < dims else 0
                          for j in range(head_dim)])  # the section (t, h, w) each dimension's frequency is in
        self.masks = [mx.array(owner == k) for k in (0, 1)]
        for layer in layers:
            layer.self_attn.rope = PositionedRoPE(layer.self_attn.rope, self)

    @contextmanager
    def at(self, positions: mx.array) -> Iterator[None]:
        """The forward built inside rotates at ``positions``."""
        self.positions = positions
        try:
            yield
        finally:
            self.positions = None


class PositionedRoPE(nn.Module):
    """A RoPE module that rotates at ``MultimodalPositions.positions`` while they are set."""

    def __init__(self, rope: nn.Module, placement: MultimodalPositions):
        super().__init__()
        self.rope = rope
        self.placement = placement

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        positions = self.placement.positions
        if positions is None:
            return self.rope(x, offset=offset)
        t, h, w = (rotate_at(self.rope, x, p) for p in positions)
        masks = self.placement.masks
        return mx.where(masks[0], t, mx.where(masks[1], h, w))


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
        raw = json.loads((path / "config.json").read_text())
        config = with_text_config(raw)
        sections = (config.get("rope_scaling") or config.get("rope_parameters") or {}).get("mrope_section")
        if sections and raw.get("model_type") not in MROPE_FAMILIES:
            raise VisionUnavailable(f"{raw.get('model_type')} adds image features to its first layers' outputs "
                                    "too (deepstack), which specd's engine does not run yet")
        model = load_model(path, lazy=True)
        language = model.language_model
        language.model.embed_tokens = decoder(text_model).embed_tokens  # the engine's own
        language.model.layers = []  # the engine's text model runs the layers
        if hasattr(language, "lm_head"):
            language.lm_head = None
        materialize(model)
        self.model = model
        config = model.config
        self.token_id = next(int(v) for v in (getattr(config, "image_token_id", None),
                                              getattr(config, "image_token_index", None)) if v is not None)
        self.processor = load_processor(path, add_detokenizer=False)
        without_text_kwargs(self.processor)
        self._special_tokens = should_add_special_tokens(config.model_type, self.processor)
        self.mrope = MultimodalPositions(text_model, sections) if sections else None
        shared = sum(v.nbytes for _, v in tree_flatten(language.model.embed_tokens.parameters()))
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - shared  # tower, projector

    def prepare(self, text: str, images: list, digests: tuple[str, ...]) -> tuple[list[int], PromptImages]:
        """A rendered prompt and its images through the processor (CPU work, any thread): the
        prompt's token ids, each image's tokens expanded, and its pixel values."""
        from mlx_vlm.utils import prepare_inputs

        try:
            inputs = prepare_inputs(self.processor, images=images, prompts=text, image_token_index=self.token_id,
                                    add_special_tokens=self._special_tokens)
        except ValueError as exc:  # mlx-vlm's wording of the processor's refusal
            raise ImagesNotInPrompt(str(exc).removeprefix("Failed to process inputs with error: ")) from None
        ids = inputs.pop("input_ids")
        if images and not (ids == self.token_id).any().item():
            raise ImagesNotInPrompt(f"the chat template put none of the {len(images)} image(s) in the prompt "
                                    "(it renders no image parts where they stand)")
        pixel_values = inputs.pop("pixel_values")
        inputs.pop("attention_mask", None)
        positions, delta = None, 0
        if self.mrope is not None:
            index, deltas = self.model.language_model.get_rope_index(ids, image_grid_thw=inputs.get("image_grid_thw"))
            positions, delta = index[:, 0, :], int(deltas.reshape(-1)[0].item())
        mx.eval(pixel_values, inputs, positions)  # made on this thread's stream: the engine thread reads them
        return ids[0].tolist(), PromptImages(pixel_values, inputs, digests, self.token_id, positions, delta)

    def embeddings(self, prompt: list[int], images: PromptImages) -> mx.array:
        """(len(prompt), hidden): the prompt's input embeddings, image features in place (engine thread)."""
        ids = mx.array([prompt])
        features = self.model.get_input_embeddings(ids, images.pixel_values, mask=mx.ones_like(ids), **images.inputs)
        return features.inputs_embeds[0]

    def chunk_positions(self, rows: list[tuple[PromptImages | None, int]], width: int) -> mx.array:
        """(3, B, width) positions of a prefill chunk: ``rows[b]`` = (the row's images, the prompt
        position of the chunk's first column); a row without images at its index."""
        out = []
        for images, first in rows:
            out.append(mx.broadcast_to(mx.arange(first, first + width), (3, width)) if images is None
                       else images.positions_at(first, width))
        return mx.stack(out, axis=1)

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
