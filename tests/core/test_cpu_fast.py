"""The compiled stand-ins for MLX's CPU fallbacks of RMSNorm, LayerNorm and RoPE: bit for bit MLX's own."""

from __future__ import annotations

import itertools
import threading

import mlx.core as mx
import pytest

from specd.core import cpu_fast
from specd.core.cache import make_row_cache
from specd.core.loader import load_model

MLX = cpu_fast._ORIGINAL


def same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.fixture
def compiled_at_any_size(monkeypatch):
    """Calls of every size take the compiled stand-ins (past their size limits, which only weigh speed)."""
    monkeypatch.setattr(cpu_fast, "NORM_ELEMENTS", 1 << 30)
    monkeypatch.setattr(cpu_fast, "ROPE_ELEMENTS", 1 << 30)


@pytest.fixture
def mlx_own(monkeypatch):
    """Use MLX's own functions in ``mx.fast`` (whether or not an engine installed the stand-ins)."""
    def use(own: bool) -> None:
        for name, function in MLX.items():
            monkeypatch.setattr(mx.fast, name, function if own else getattr(cpu_fast, name))
    return use


@pytest.mark.parametrize("shape", [(1, 4, 1, 64), (3, 2, 5, 32), (8, 4, 16, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rope_matches_mlx_at_row_offsets(shape, dtype, compiled_at_any_size):
    x = (mx.random.normal(shape, key=mx.random.key(1)) * 3).astype(dtype)
    offset = mx.random.randint(0, 4000, (shape[0],), key=mx.random.key(2))
    dims = shape[-1]
    for traditional, base, scale, rotated in itertools.product((False, True), (10000.0, 1e6), (1.0, 0.25),
                                                               (dims, dims // 2)):
        args = dict(traditional=traditional, base=base, scale=scale, offset=offset)
        assert same(cpu_fast.rope(x, rotated, **args), MLX["rope"](x, rotated, **args)), args
    freqs = mx.random.uniform(1, 500, (dims // 2,), key=mx.random.key(3))  # Llama 3, YaRN and LongRoPE scaling
    args = dict(traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)
    assert same(cpu_fast.rope(x, dims, **args), MLX["rope"](x, dims, **args))


@pytest.mark.parametrize("shape", [(1, 1, 64), (4, 3, 256), (16, 2, 48), (5, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_norms_match_mlx(shape, dtype, compiled_at_any_size):
    x = (mx.random.normal(shape, key=mx.random.key(4)) * 5).astype(dtype)
    weight = mx.random.normal(shape[-1:], key=mx.random.key(5)).astype(dtype)
    bias = mx.random.normal(shape[-1:], key=mx.random.key(6)).astype(dtype)
    for eps in (1e-5, 1e-6):
        for w in (weight, None):
            assert same(cpu_fast.rms_norm(x, w, eps), MLX["rms_norm"](x, w, eps))
            for b in (bias, None):
                assert same(cpu_fast.layer_norm(x, w, b, eps), MLX["layer_norm"](x, w, b, eps))


def test_large_arrays_and_int_offsets_take_mlx_own(monkeypatch):
    taken = []
    for name, function in cpu_fast.COMPILED.items():
        monkeypatch.setitem(cpu_fast.COMPILED, name,
                            lambda *args, name=name, function=function: taken.append(name) or function(*args))
    chunk = mx.random.normal((2, 4, 64, 32), key=mx.random.key(7))  # a prefill chunk's
    offset = mx.array([3, 9])
    cpu_fast.rope(chunk, 32, traditional=False, base=10000.0, scale=1.0, offset=offset)
    cpu_fast.rms_norm(chunk, None, 1e-5)
    cpu_fast.layer_norm(chunk, None, None, 1e-5)
    step = chunk[:, :, :1]  # a decode step's
    cpu_fast.rope(step, 32, traditional=False, base=10000.0, scale=1.0, offset=5)
    assert not taken
    cpu_fast.rope(step, 32, traditional=False, base=10000.0, scale=1.0, offset=offset)
    cpu_fast.rms_norm(step, None, 1e-5)
    assert taken == ["rope", "rms_norm"]


def test_threads_calling_with_other_settings_at_one_shape_each_get_their_own():
    """MLX keeps compiled traces per thread, keyed by the traced function: calls of one shape from
    several threads (engines), interleaving settings (eps, dims, base, scale, traditional), each
    give MLX's own numbers."""
    x = mx.random.normal((2, 2, 1, 32), key=mx.random.key(8))
    offset = mx.array([4, 17])
    mx.eval(x, offset)  # not lazy arrays of this thread's stream
    settings = [(eps, dims, dict(traditional=traditional, base=base, scale=1.0, offset=offset))
                for eps, dims, traditional, base in itertools.product((1e-5, 1e-6), (32, 16), (False, True),
                                                                      (1e4, 1e6))]
    mismatches = []

    def calls(thread: int) -> None:
        for i in range(3 * len(settings)):
            eps, dims, rope = settings[(i * (thread + 1)) % len(settings)]
            try:
                if not (same(cpu_fast.rms_norm(x, None, eps), MLX["rms_norm"](x, None, eps))
                        and same(cpu_fast.rope(x, dims, **rope), MLX["rope"](x, dims, **rope))):
                    mismatches.append((thread, i))
            except Exception as error:
                mismatches.append((thread, i, error))

    threads = [threading.Thread(target=calls, args=(thread,)) for thread in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not mismatches


# norms and RoPE as families write them: mlx.nn's layers, Llama 3 and LongRoPE scaling (freqs), YaRN with
# attention sinks, Gemma's (1 + weight) norms, Qwen 3's norms of queries and keys, LayerNorm with partial RoPE
@pytest.mark.parametrize("family", ["llama", "phi3", "gpt_oss", "gemma3_text", "qwen3", "phi"])
def test_families_decode_bit_for_bit_with_the_stand_ins(family, family_models, mlx_own, compiled_at_any_size):
    model, tokenizer = load_model(str(family_models(family)))
    prompt = mx.array([tokenizer.encode("def parse(line):\n    return line.split()")[:12]] * 3)
    logits = {}
    for own in (True, False):
        mlx_own(own)
        cache = make_row_cache(model, [0, 0, 0])
        prefill = cache.forward(model, prompt)
        step = cache.forward(model, mx.array([[5], [7], [11]]))
        logits[own] = mx.concatenate([prefill[:, -1], step[:, -1]])
    assert same(logits[True], logits[False])


def test_install_puts_the_stand_ins_in_mx_fast(monkeypatch):
    for name in MLX:
        monkeypatch.setattr(mx.fast, name, MLX[name])
    monkeypatch.setattr(cpu_fast, "_installed", False)
    cpu_fast.install()
    cpu_fast.install()
    assert (mx.fast.rms_norm, mx.fast.layer_norm, mx.fast.rope) == (cpu_fast.rms_norm, cpu_fast.layer_norm,
                                                                     cpu_fast.rope)
