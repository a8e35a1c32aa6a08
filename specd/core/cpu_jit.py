"""MLX's CPU kernels compiled with this CPU's fused multiply-add, for the same numbers sooner.

``mx.compile`` on MLX's CPU backend writes each fused kernel as C++ and builds it with ``g++``
(mlx-lm's SwiGLU and GELU, the attention softmax, ``core.cpu_fast``'s norms and RoPE). MLX adds
``-mavx2 -mfma -mf16c`` to that command only when MLX itself was built for AVX2, and the Linux
wheel is not: its kernels then call libm's ``fmaf`` for every step of MLX's ``exp`` polynomial,
so a sigmoid costs several function calls an element. The instruction gives the same correctly
rounded result as ``fmaf``, so with contraction off (no ``a * b + c`` fused that MLX's source did
not fuse) the kernels give MLX's own numbers bit for bit, faster
(``ops/bench/results/cpu_jit.json``).

``install`` (once a process, on Linux x86-64 CPUs with AVX2, FMA and F16C and a ``g++``) puts a
``g++`` first on ``PATH`` that adds those flags, and points MLX's kernel cache (``$TMPDIR/mlx``)
at a directory of specd's own: kernels another process built without them (``mlx_lm.server``,
an older specd) are not taken, and theirs do not get these. Python's own temporary directory is
kept as it was. Kernels MLX already built in this process before ``install`` stay as built, so
models are loaded after it (``core.loader``). The daemon and a group's ranks install it at start,
on their main thread, before engine threads run: ``os.environ`` is better not set beside them.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

FLAGS = ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off")
CPU_FEATURES = ("avx2", "fma", "f16c")

_installed = False


def cache_dir() -> Path:
    """Where the ``g++`` wrapper and MLX's kernels built with it live (per user)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    if not base.is_absolute():  # no home to keep it in
        raise RuntimeError(f"no cache directory: {base} is not an absolute path")
    return base / "specd" / "mlx-jit"


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(flags.partition(":")[2].split())


def compiler() -> str | None:
    """The ``g++`` MLX would call, not this module's wrapper (which a child process inherits first
    on ``PATH``)."""
    wrapper = cache_dir() / "bin"
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != wrapper)
    found = shutil.which("g++", path=path)
    return None if found is None else str(Path(found).resolve())


def applies() -> bool:
    """Whether MLX's kernels here are built without the CPU's FMA: Linux on x86-64 with AVX2,
    FMA and F16C, and a ``g++`` for MLX to call."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and set(CPU_FEATURES) <= cpu_features() and compiler() is not None)


def _write_wrapper(directory: Path, compiler: str) -> None:
    """``directory/g++``: ``compiler`` with ``FLAGS`` (written whole, then renamed into place)."""
    directory.mkdir(parents=True, exist_ok=True)
    script = f'#!/bin/sh\nexec {shlex.quote(compiler)} {" ".join(FLAGS)} "$@"\n'
    target = directory / "g++"
    if target.exists() and target.read_text() == script:
        return
    fd, staged = tempfile.mkstemp(dir=directory, prefix=".g++.")
    with os.fdopen(fd, "w") as out:
        out.write(script)
    os.chmod(staged, 0o755)
    os.replace(staged, target)


def install() -> bool:
    """Have MLX build its CPU kernels with ``FLAGS`` from now on (where ``applies``); whether it does."""
    global _installed
    if _installed:
        return True
    try:
        if not applies():
            return False
        root = cache_dir()
        _write_wrapper(root / "bin", compiler())
        (root / "tmp").mkdir(exist_ok=True)
    except (OSError, RuntimeError) as error:  # no home, or a read-only one: MLX's kernels as MLX builds them
        log.warning("cannot write the MLX compiler wrapper; CPU kernels built without FMA", error=str(error))
        return False
    tempfile.gettempdir()  # Python's temporary directory stays what it was (it is read once)
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([str(root / "bin")] + [p for p in path if Path(p) != root / "bin"])
    os.environ["TMPDIR"] = str(root / "tmp")  # MLX reads it at each new kernel
    _installed = True
    return True
