"""MLX's CPU kernels built with the CPU's FMA (``core.cpu_jit``): built so, and MLX's own numbers bit for bit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specd.core import cpu_jit

pytestmark = pytest.mark.skipif(not cpu_jit.applies(), reason="an x86-64 Linux CPU with FMA and a g++")

# In a fresh process (MLX keeps the kernels it built): compiled functions (mlx-lm's, specd's, MLX's ops
# compiled here) on values from exp's underflow to its overflow, against the same with compilation off;
# prints where the kernels were built
PROGRAM = textwrap.dedent("""
    import os, sys, tempfile, mlx.core as mx, mlx.nn as nn
    from mlx_lm.models.activations import swiglu
    from specd.core import attention, cpu_fast, cpu_jit
    if sys.argv[1] == "install":
        assert cpu_jit.install()
    x = mx.concatenate([mx.random.normal((4096,), key=mx.random.key(1)) * 8, mx.linspace(-120, 120, 4096)])
    y = mx.random.normal((8192,), key=mx.random.key(2))
    rows, weight, bias = x.reshape(8, 4, 2, 128), y[:128], y[128:256]
    ops = {name: mx.compile(op) for name, op in
           {"sigmoid": mx.sigmoid, "exp": mx.exp, "gelu": nn.gelu, "tanh": mx.tanh, "softmax": mx.softmax}.items()}

    def run():
        return {**{name: op(x) for name, op in ops.items()}, "swiglu": swiglu(x, y),
                "exp2 parts": attention._exp2_parts(rows, rows.max(axis=-1, keepdims=True))[0],
                "rms_norm": cpu_fast.COMPILED["rms_norm"](rows, weight, 1e-5),
                "layer_norm": cpu_fast.COMPILED["layer_norm"](rows, weight, bias, 1e-5),
                "rope": cpu_fast.COMPILED["rope"](rows, mx.arange(8), None, 128, False, 1e4, 1.0)}
    fused = run()
    mx.eval(fused)
    mx.disable_compile()
    for name, unfused in run().items():
        assert mx.array_equal(fused[name], unfused).item(), name
    print(os.environ.get("TMPDIR", tempfile.gettempdir()))
""")


def built_kernels(tmp_path: Path, install: bool) -> list[Path]:
    # not this process's wrapper either, where an engine here installed it
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != cpu_jit.cache_dir() / "bin")
    env = {**os.environ, "PATH": path, "XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", PROGRAM, "install" if install else "as is"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return sorted(Path(done.stdout.strip()).glob("mlx/*/cpu/*Sigmoid*.so"))


def disassembly(library: Path) -> str:
    return subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) reads the kernels")
def test_kernels_use_the_fma_instruction_and_give_mlx_own_numbers(tmp_path):
    kernels = built_kernels(tmp_path, install=True)
    assert kernels and all(str(k).startswith(str(tmp_path / "cache" / "specd" / "mlx-jit")) for k in kernels)
    code = disassembly(kernels[0])
    assert "vfmadd" in code and "fmaf@plt" not in code
    # as MLX builds them without: libm's fmaf for every fused multiply-add (and the same numbers)
    plain = built_kernels(tmp_path, install=False)
    assert plain and "fmaf@plt" in disassembly(plain[0])


def test_a_child_process_finds_the_compiler_not_the_wrapper(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    wrapper = cpu_jit.cache_dir() / "bin"
    monkeypatch.setenv("PATH", f"{wrapper}{os.pathsep}{os.environ['PATH']}")
    cpu_jit._write_wrapper(wrapper, cpu_jit.compiler())
    assert cpu_jit.compiler() == str(Path(shutil.which("g++", path=os.environ["PATH"].split(os.pathsep, 1)[1]))
                                     .resolve())
    assert f"exec {cpu_jit.compiler()} " in (wrapper / "g++").read_text()
