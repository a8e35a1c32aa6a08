"""``specd doctor``: is this host ready to serve?

Each check reports ``ok``, ``warn``, ``fail`` or ``skip`` (not applicable
here) with a one-line message and, when something is wrong, how to fix it.
The exit status is 1 when a check failed, else 0 (warnings allowed).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import service

STATUSES = ("ok", "warn", "fail", "skip")
MIN_PYTHON = (3, 11)
MIN_RDMA_MACOS = (26, 2)
FAST_BLAS_GFLOPS = 25.0  # the reference BLAS manages ~3-6 GFLOP/s, OpenBLAS ~100+
MATMUL_N = 512
MIN_FREE_DISK = 1 << 30
GiB = 1 << 30


@dataclass
class Check:
    name: str
    status: str
    message: str
    hint: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def _size(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


# --------------------------------------------------------------------------- checks


def check_platform() -> Check:
    system = platform.system()
    py = platform.python_version()
    message = f"{system} {platform.release()} {platform.machine()}, Python {py} ({sys.executable})"
    details = {"system": system, "release": platform.release(), "machine": platform.machine(),
               "python": py, "executable": sys.executable}
    if sys.version_info[:2] < MIN_PYTHON:
        return Check("platform", "fail", message, "specd needs Python >= 3.11", details)
    if system == "Darwin" and platform.machine() != "arm64":
        return Check("platform", "warn", message + ": not Apple Silicon",
                     "MLX's Metal backend needs an Apple Silicon Mac", details)
    if system not in ("Darwin", "Linux"):
        return Check("platform", "warn", message + ": untested platform",
                     "specd runs on macOS (Apple Silicon) and Linux", details)
    return Check("platform", "ok", message, details=details)


def check_mlx() -> Check:
    try:
        import mlx.core as mx
    except (ImportError, OSError) as err:  # not installed, or a broken native library
        wheel = "mlx" if sys.platform == "darwin" else "'mlx[cpu]'"
        return Check("mlx", "fail", f"cannot import mlx: {err}", f"pip install {wheel}")
    device = str(mx.default_device())
    details: dict[str, Any] = {"version": mx.__version__, "default_device": device}
    message = f"mlx {mx.__version__}, default device {device}"
    if sys.platform == "darwin":
        metal = bool(mx.metal.is_available())
        details["metal"] = metal
        if not metal:
            return Check("mlx", "warn", message + ", Metal not available: MLX runs on the CPU",
                         "run on an Apple Silicon Mac with the `mlx` wheel (not mlx[cpu])", details)
        message += ", Metal available"
    return Check("mlx", "ok", message, details=details)


def loaded_blas_libraries() -> list[str]:
    """Shared libraries with BLAS in their name mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    libs = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    return sorted(lib for lib in libs if "blas" in Path(lib).name.lower())


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def global_sgemm_provider() -> str | None:
    """The library whose ``cblas_sgemm`` the process's global scope resolves.

    MLX's CPU backend binds ``cblas_sgemm`` through the global scope first
    (the executable, preloaded libraries), then its own bundled reference
    BLAS; libraries Python extensions load (numpy's OpenBLAS, say) stay local
    and do not count.  None: nothing global, so MLX uses its bundled BLAS."""
    process = ctypes.CDLL(None)
    try:
        fn = process.cblas_sgemm
        dladdr = process.dladdr
    except AttributeError:
        return None
    info = _DlInfo()
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode(errors="replace")


def matmul_gflops(n: int = MATMUL_N, reps: int = 5) -> float:
    """The best of ``reps`` float32 n×n matmuls, in GFLOP/s."""
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(0))
    b = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(1))
    mx.eval(a, b, a @ b)  # warm up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def blas_fix_hint(env_file: str = service.LINUX_ENV_FILE) -> str:
    lib = service.openblas_path()
    state = "installed here" if Path(lib).exists() else "not installed here"
    return (f"apt install libopenblas0-pthread ({state}), then export LD_PRELOAD={lib} before "
            "running specd (in a specd checkout: source ops/env.sh); for the service, set "
            f"LD_PRELOAD={lib} in {env_file}, then systemctl restart specd")


def check_blas() -> Check:
    if sys.platform != "linux":
        return Check("blas", "skip", "not applicable: MLX uses Accelerate and Metal on macOS")
    libs = loaded_blas_libraries()
    provider = global_sgemm_provider()
    mlx_blas = [lib for lib in libs if "mlx" in lib.lower()]
    try:
        gflops = matmul_gflops()
    except (RuntimeError, ValueError) as err:
        return Check("blas", "fail", f"float32 matmul failed: {err}", "reinstall mlx[cpu]",
                     {"libraries": libs})
    openblas = provider is not None and "openblas" in provider.lower()
    sgemm = provider or (mlx_blas[0] if mlx_blas else "MLX's bundled BLAS")
    details = {"sgemm_provider": sgemm, "openblas": openblas, "gflops": round(gflops, 1),
               "matmul": MATMUL_N, "libraries": libs, "ld_preload": os.environ.get("LD_PRELOAD", "")}
    speed = f"float32 {MATMUL_N}x{MATMUL_N} matmul {gflops:.1f} GFLOP/s"
    if openblas:
        return Check("blas", "ok", f"OpenBLAS ({provider}); {speed}", details=details)
    if gflops >= FAST_BLAS_GFLOPS:
        return Check("blas", "ok", f"no OpenBLAS, but a fast BLAS ({sgemm}): {speed}", details=details)
    return Check("blas", "warn",
                 f"reference BLAS ({sgemm}): {speed}; OpenBLAS gives ~100+",
                 blas_fix_hint(), details)


def memory_info() -> tuple[int | None, int | None]:
    """(total, available) bytes of RAM, None where unknown."""
    if sys.platform == "linux":
        values = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[key] = int(parts[0]) * 1024
        return values.get("MemTotal"), values.get("MemAvailable", values.get("MemFree"))
    if sys.platform == "darwin":
        total = available = None
        try:
            total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], check=False, capture_output=True,
                                       text=True, timeout=5).stdout.strip())
            vm = subprocess.run(["vm_stat"], check=False, capture_output=True, text=True, timeout=5).stdout
            page = int(re.search(r"page size of (\d+) bytes", vm).group(1))
            pages = {m.group(1): int(m.group(2)) for m in re.finditer(r"Pages ([\w ]+):\s+(\d+)", vm)}
            available = page * sum(pages.get(k, 0) for k in ("free", "inactive", "speculative", "purgeable"))
        except (OSError, ValueError, AttributeError, subprocess.SubprocessError):
            pass
        return total, available
    return None, None


def hf_hub_caches(state_dir: Path | None) -> list[Path]:
    """Where hub models may be cached: this user's Hugging Face cache, and the
    service's (``HF_HOME`` under the state dir, as the service units set it)."""
    if os.environ.get("HF_HUB_CACHE"):
        caches = [Path(os.environ["HF_HUB_CACHE"])]
    elif os.environ.get("HF_HOME"):
        caches = [Path(os.environ["HF_HOME"]) / "hub"]
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        caches = [Path(xdg) / "huggingface" / "hub"]
    if state_dir is not None:
        caches.append(state_dir / "huggingface" / "hub")
    return caches


def _safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors") if p.is_file())


def weights_size(source: str, revision: str | None, caches: list[Path]) -> tuple[int | None, str]:
    """(bytes of *.safetensors, where they are or why unknown) for a model source."""
    from .core.loader import is_local_source

    if is_local_source(source):
        path = Path(source).expanduser()
        if not path.is_dir():
            return None, f"{path} does not exist"
        size = _safetensors_bytes(path)
        return (size, str(path)) if size else (None, f"{path} has no *.safetensors")
    folder = "models--" + source.replace("/", "--")
    for cache in caches:
        repo = cache / folder
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else revision
        candidates = [snapshots / commit] if commit and (snapshots / commit).is_dir() else \
            sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for snap in candidates:
            size = _safetensors_bytes(snap)
            if size:
                return size, str(snap)
    return None, "not in the Hugging Face cache (downloaded at first load)"


def declared_weights(resources: list, caches: list[Path]) -> list[dict[str, Any]]:
    """One entry per set of weights the daemon would load: Models and draft models."""
    out = []
    for r in resources:
        if r.kind == "Model":
            source, revision = r.spec.source, r.spec.revision
        elif r.kind == "DraftPairing" and r.spec.method == "draft" and r.spec.source:
            source, revision = r.spec.source, None
        else:
            continue
        size, where = weights_size(source, revision, caches)
        out.append({"kind": r.kind, "name": r.name, "source": source, "bytes": size, "where": where})
    return out


def _metal_working_set() -> int | None:
    if sys.platform != "darwin":
        return None
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return int(info["max_recommended_working_set_size"])
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        return None


def check_memory(resources: list | None, state_dir: Path | None) -> Check:
    total, available = memory_info()
    if total is None or available is None:
        return Check("memory", "warn", "cannot read this host's memory size",
                     "on Linux /proc/meminfo, on macOS sysctl hw.memsize and vm_stat must be readable")
    have = f"{_size(available)} available of {_size(total)}"
    details: dict[str, Any] = {"total_bytes": total, "available_bytes": available}
    if resources is None:
        return Check("memory", "ok", f"{have} (pass --manifests DIR to compare with the models)",
                     details=details)
    weights = declared_weights(resources, hf_hub_caches(state_dir))
    details["models"] = weights
    known = sum(w["bytes"] for w in weights if w["bytes"] is not None)
    unknown = [w for w in weights if w["bytes"] is None]
    details["needed_bytes"] = known
    need = f"the declared models' weights take {_size(known)}"
    if unknown:
        need += f" + {len(unknown)} of unknown size"
    message = f"{need}; {have}"
    if known > total:
        biggest = max((w for w in weights if w["bytes"]), key=lambda w: w["bytes"])
        return Check("memory", "fail", message + ": they cannot fit",
                     f"serve fewer or smaller (quantized) models; the biggest is "
                     f"{biggest['kind']} {biggest['name']} ({_size(biggest['bytes'])})", details)
    working_set = _metal_working_set()
    if working_set is not None:
        details["metal_working_set_bytes"] = working_set
        if known > working_set:
            return Check("memory", "warn", f"{message}; above Metal's recommended working set "
                         f"({_size(working_set)})",
                         "serve smaller models, or raise the GPU wired limit (sysctl iogpu.wired_limit_mb)",
                         details)
    if known > available:
        return Check("memory", "warn", message + ": more than is available now",
                     "free memory, or serve fewer models (if specd already runs them, their "
                     "weights are counted as in use)", details)
    from .control.node import Node

    allocatable = details["node_allocatable_bytes"] = Node().allocatable
    requests = declared_requests(resources, allocatable)
    details["requests"] = requests
    pinned = sum(r["bytes"] for r in requests if r["minReplicas"])
    message += f"; with their KV and prefix budgets, the Models loaded at all times request {_size(pinned)} " \
               f"of the node's {_size(allocatable)} allocatable"
    never = [r for r in requests if r["bytes"] > allocatable]
    if never or pinned > allocatable:
        return Check("memory", "warn", message + (": some can never fit" if never else ": not all fit at once"),
                     "the ones that do not fit stay Unschedulable: lower kvCache.maxBytes or prefixCache.maxBytes, "
                     "or give some scaling.minReplicas: 0 to load them on demand"
                     + (f" ({', '.join(r['name'] for r in never)} can never fit)" if never else ""), details)
    if unknown:
        names = ", ".join(f"{w['kind']} {w['name']} ({w['source']}: {w['where']})" for w in unknown)
        return Check("memory", "warn", message, f"cannot size {names}", details)
    return Check("memory", "ok", message, details=details)


def declared_requests(resources: list, allocatable: int) -> list[dict[str, Any]]:
    """The memory each declared Model would request of a node of ``allocatable`` bytes (``control.resources``), where
    its checkpoint is on this machine already; Models served by a Topology are placed elsewhere."""
    from .engine.resources import memory_request

    pairings = {r.spec.target_ref: r.spec for r in resources if r.kind == "DraftPairing"}
    out = []
    for r in resources:
        if r.kind != "Model" or r.spec.topology_ref is not None:
            continue
        pairing = pairings.get(r.name)
        drafter = pairing.source if pairing is not None and pairing.method != "ngram" else None
        try:
            request = memory_request(r.spec, drafter, allocatable, local_only=True)
        except Exception:  # not downloaded yet: sized when it loads
            continue
        out.append({"name": r.name, "bytes": request.total, "minReplicas": r.spec.min_replicas,
                    **request.as_dict()})
    return out


def check_manifests(manifests: Path | None) -> tuple[Check, list | None]:
    if manifests is None:
        return Check("manifests", "skip", "no --manifests given"), None
    from .api.manifest import ManifestError, load_manifest_dir

    if not manifests.is_dir():
        return Check("manifests", "fail", f"{manifests} is not a directory",
                     "pass the daemon's --manifests directory"), None
    try:
        resources = load_manifest_dir(manifests)
    except ManifestError as err:
        return Check("manifests", "fail", f"invalid manifest: {err}", "fix the file named above"), None
    counts: dict[str, int] = {}
    for r in resources:
        counts[r.kind] = counts.get(r.kind, 0) + 1
    problems = []
    for r in resources:
        source = getattr(r.spec, "source", None)
        if r.kind in ("Model", "DraftPairing") and source:
            from .core.loader import is_local_source

            path = Path(source).expanduser()
            if is_local_source(source) and not (path / "config.json").is_file():
                problems.append(f"{r.kind} {r.name}: {path} is not an mlx-lm model directory")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no objects"
    details = {"directory": str(manifests), "objects": counts}
    if problems:
        return Check("manifests", "fail", f"{summary} in {manifests}; " + "; ".join(problems),
                     "point spec.source at a directory with config.json and *.safetensors", details), resources
    return Check("manifests", "ok", f"{summary} in {manifests}", details=details), resources


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_state_dir(state_dir: Path) -> Check:
    state_dir = state_dir.absolute()
    details: dict[str, Any] = {"path": str(state_dir)}
    hint = f"create it writable for the user that runs specd, or pass --state-dir (now {state_dir})"
    existing = _nearest_existing(state_dir)
    try:
        free = shutil.disk_usage(existing).free
        details["free_bytes"] = free
    except OSError:
        free = None
    if state_dir.exists():
        if not state_dir.is_dir():
            return Check("state-dir", "fail", f"{state_dir} is not a directory", hint, details)
        try:
            with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".specd-doctor-"):
                pass
        except OSError as err:
            return Check("state-dir", "fail", f"{state_dir} is not writable: {err.strerror}", hint, details)
        db = state_dir / "specd.db"
        if db.exists() and not os.access(db, os.R_OK | os.W_OK):
            return Check("state-dir", "fail", f"{db} is not writable", hint, details)
        message = f"{state_dir} is writable"
    else:
        if not existing.is_dir():
            return Check("state-dir", "fail",
                         f"{state_dir} cannot be created: {existing} is not a directory", hint, details)
        first_missing = state_dir
        while first_missing.parent != existing:
            first_missing = first_missing.parent
        try:  # os.access would answer yes to root anywhere: really try
            first_missing.mkdir()
            first_missing.rmdir()
        except OSError as err:
            return Check("state-dir", "fail", f"{state_dir} cannot be created in {existing}: "
                         f"{err.strerror}", hint, details)
        message = f"{state_dir} does not exist yet; the daemon will create it"
    if free is not None:
        message += f" ({_size(free)} free)"
        if free < MIN_FREE_DISK:
            return Check("state-dir", "warn", message, "free disk space: the store and hub downloads "
                         "live here", details)
    return Check("state-dir", "ok", message, details=details)


def _env_file_of(unit: Path) -> str | None:
    for line in unit.read_text().splitlines():
        if line.startswith("EnvironmentFile="):
            return line.split("=", 1)[1].lstrip("-")
    return None


def check_service() -> Check:
    if sys.platform == "darwin":
        for path in (Path(service.DARWIN_SYSTEM_PLIST_DIR), Path.home() / service.DARWIN_AGENT_PLIST_DIR):
            plist = path / f"{service.LAUNCHD_LABEL}.plist"
            if plist.exists():
                return Check("service", "ok", f"launchd job installed: {plist}")
        return Check("service", "skip", "no launchd job installed (specd service install)")
    unit = Path(service.LINUX_UNIT_PATH)
    if not unit.exists():
        return Check("service", "skip", "no systemd unit installed (specd service install)")
    env_file = _env_file_of(unit)
    details = {"unit": str(unit), "env_file": env_file}
    if env_file is None:
        return Check("service", "warn", f"{unit} has no EnvironmentFile: no OpenBLAS preload",
                     "re-run specd service install", details)
    try:
        text = Path(env_file).read_text()
    except FileNotFoundError:
        text = ""
    except OSError as err:
        return Check("service", "warn", f"{unit} installed; cannot read {env_file}: {err.strerror}",
                     "run specd doctor as root to check the service's environment", details)
    preload = [line for line in text.splitlines() if re.match(r"\s*LD_PRELOAD=\S*openblas", line)]
    if sys.platform == "linux" and not preload:
        return Check("service", "warn", f"{unit} installed, but {env_file} does not preload OpenBLAS",
                     blas_fix_hint(env_file), details)
    return Check("service", "ok", f"{unit} installed; {env_file} preloads OpenBLAS", details=details)


def _run(argv: list[str]) -> str | None:
    try:
        result = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (result.stdout + result.stderr).strip()


def check_vision(resources: list | None) -> Check:
    """Images need mlx-vlm (``specd[vision]``): a failure where a Model names image in its
    modalities and it is missing, a warning where it is missing and no Model asks."""
    try:
        found = importlib.util.find_spec("mlx_vlm") is not None
    except ImportError:  # a broken install
        found = False
    if found:
        version = importlib.metadata.version("mlx-vlm")
        return Check("vision", "ok", f"mlx-vlm {version}: vision-language Models take images",
                     details={"mlx_vlm": version})
    asking = [r.name for r in resources or () if r.kind == "Model" and "image" in (r.spec.modalities or ())]
    if asking:
        return Check("vision", "fail", f"mlx-vlm is not installed, and {', '.join(asking)} name image in "
                     "their modalities: they will not load", "pip install 'specd[vision]'")
    return Check("vision", "warn", "mlx-vlm is not installed: vision-language Models serve text only",
                 "pip install 'specd[vision]'")


def check_rdma(resources: list | None) -> Check:
    if sys.platform != "darwin":
        return Check("rdma", "skip", "not applicable: JACCL (RDMA over Thunderbolt 5) is macOS-only")
    version = platform.mac_ver()[0]
    details: dict[str, Any] = {"macos": version}
    problems, hints = [], []
    if _version_tuple(version) < MIN_RDMA_MACOS:
        problems.append(f"macOS {version} (RDMA over Thunderbolt needs 26.2+)")
        hints.append("upgrade to macOS 26.2 or later on a Mac with Thunderbolt 5")
    rdma_ctl = shutil.which("rdma_ctl") or ("/usr/bin/rdma_ctl" if Path("/usr/bin/rdma_ctl").exists() else None)
    if rdma_ctl is None:
        problems.append("no rdma_ctl")
    else:
        status = _run([rdma_ctl, "status"]) or ""
        details["rdma_ctl_status"] = status
        if "enabled" in status.lower() and "disabled" not in status.lower():
            enabled = True
        else:
            enabled = False
            problems.append(f"RDMA not enabled (rdma_ctl status: {status or 'no answer'})")
            hints.append("enable it once in macOS Recovery: Utilities > Terminal, rdma_ctl enable, reboot")
        details["rdma_enabled"] = enabled
    if shutil.which("ibv_devices"):
        out = _run(["ibv_devices"]) or ""
        devices = [line.split()[0] for line in out.splitlines()[2:] if line.strip()]
        details["rdma_devices"] = devices
    bridge = _run(["ifconfig", "bridge0"])
    if bridge and "member" in bridge:
        details["thunderbolt_bridge"] = True
        hints.append("the Thunderbolt Bridge (bridge0) holds Thunderbolt ports: MLX's distributed "
                     "set-up wants them unbridged (mlx.distributed_config --backend jaccl "
                     "--over thunderbolt --auto-setup configures them)")
    jaccl = [r.name for r in resources or [] if r.kind == "Topology" and r.spec.backend == "jaccl"]
    details["jaccl_topologies"] = jaccl
    summary = "; ".join(problems) if problems else f"macOS {version}, RDMA enabled"
    if not jaccl:
        return Check("rdma", "skip", f"{summary}; not needed: no Topology uses backend jaccl",
                     "; ".join(hints), details)
    if problems:
        return Check("rdma", "warn", f"{summary}; needed by Topology {', '.join(jaccl)}", "; ".join(hints),
                     details)
    return Check("rdma", "ok", summary, "; ".join(hints), details)


# --------------------------------------------------------------------------- running


def _guard(name: str, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - a check must not take the others down
        return Check(name, "fail", f"the check itself failed: {type(err).__name__}: {err}",
                     "report this as a specd bug")


def run_checks(manifests: Path | None, state_dir: Path) -> list[Check]:
    checks = [_guard("platform", check_platform), _guard("mlx", check_mlx), _guard("blas", check_blas)]
    loaded: list[list] = []

    def manifests_check() -> Check:
        check, resources = check_manifests(manifests)
        if resources is not None:
            loaded.append(resources)
        return check

    manifest_check = _guard("manifests", manifests_check)
    resources = loaded[0] if loaded else None
    checks.append(manifest_check)
    if manifest_check.status == "fail" and resources is None:
        checks.append(Check("memory", "skip", "manifests did not load"))
    else:
        checks.append(_guard("memory", lambda: check_memory(resources, state_dir)))
    checks += [_guard("state-dir", lambda: check_state_dir(state_dir)),
               _guard("service", check_service),
               _guard("vision", lambda: check_vision(resources)),
               _guard("rdma", lambda: check_rdma(resources))]
    return checks


def render_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'CHECK':<{width}}  STATUS  MESSAGE"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {c.status:<6}  {c.message}")
        if c.hint and c.status in ("warn", "fail"):
            lines.append(f"{'':<{width}}  {'':<6}  fix: {c.hint}")
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args.manifests, args.state_dir)
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render_table(checks))
    return 1 if failed else 0
