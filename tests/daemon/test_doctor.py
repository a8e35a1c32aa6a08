"""`specd doctor`: real checks of this host, run as the command in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import model_manifest

from specd import service

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["platform", "mlx", "blas", "manifests", "memory", "state-dir", "service", "vision", "rdma"]
OPENBLAS = service.openblas_path()


def doctor(*args: str, preload: bool | None = None, table: bool = False,
           env: dict | None = None) -> tuple[int, dict | str]:
    """Run `specd doctor`; ``preload`` True/False sets or strips OpenBLAS's LD_PRELOAD."""
    env = {**os.environ, **(env or {})}
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = OPENBLAS
    elif preload is None and "LD_PRELOAD" in os.environ:
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    cmd = [sys.executable, "-m", "specd.cli", "doctor", *args, *([] if table else ["--json"])]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    if table:
        return result.returncode, result.stdout
    report = json.loads(result.stdout)
    assert [c["name"] for c in report["checks"]] == NAMES
    for c in report["checks"]:
        assert c["status"] in ("ok", "warn", "fail", "skip") and c["message"], c
        if c["status"] in ("warn", "fail"):
            assert c["hint"], c
    assert report["ok"] == (result.returncode == 0) == all(c["status"] != "fail" for c in report["checks"])
    return result.returncode, {c["name"]: c for c in report["checks"]}


def linux_with_openblas():
    if sys.platform != "linux":
        pytest.skip("the BLAS check is Linux's")
    if not Path(OPENBLAS).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{OPENBLAS} is required under CI (ops/env.sh installs it)")
        pytest.skip("OpenBLAS (libopenblas0-pthread) is not installed")


@pytest.fixture
def manifests(tmp_path, forged) -> Path:
    """The forged test pair declared as a Model and its draft."""
    directory = tmp_path / "manifests"
    directory.mkdir()
    pairing = (f"apiVersion: specd.dev/v1alpha1\nkind: DraftPairing\nmetadata:\n  name: tiny-draft\n"
               f"spec:\n  targetRef: tiny\n  method: draft\n  source: {forged / 'draft'}\n")
    (directory / "models.yaml").write_text(model_manifest("tiny", forged / "target") + "---\n" + pairing)
    return directory


def test_healthy_host_with_openblas(tmp_path, manifests, forged):
    linux_with_openblas()
    code, checks = doctor("--manifests", str(manifests), "--state-dir", str(tmp_path / "state"), preload=True)
    assert code == 0, checks
    blas = checks["blas"]
    assert blas["status"] == "ok" and blas["details"]["openblas"], blas
    assert blas["details"]["sgemm_provider"] == OPENBLAS
    assert checks["manifests"]["status"] == "ok" and checks["manifests"]["details"]["objects"] == \
        {"DraftPairing": 1, "Model": 1}
    memory = checks["memory"]
    assert memory["status"] == "ok", memory
    weights = sum(p.stat().st_size for m in ("target", "draft") for p in (forged / m).glob("*.safetensors"))
    assert memory["details"]["needed_bytes"] == weights > 0
    (request,) = memory["details"]["requests"]  # weights, budgets and overhead, as the daemon places it
    assert request["name"] == "tiny" and request["drafter"] > 0 and request["bytes"] > weights
    assert "request" in memory["message"] and "allocatable" in memory["message"]
    assert checks["state-dir"]["status"] == "ok" and "will create it" in checks["state-dir"]["message"]
    assert not (tmp_path / "state").exists(), "doctor must not create the state dir"
    assert checks["rdma"]["status"] == "skip" and "not applicable" in checks["rdma"]["message"]
    assert checks["mlx"]["status"] == "ok" and checks["mlx"]["details"]["version"]
    assert checks["vision"]["status"] == "ok" and checks["vision"]["details"]["mlx_vlm"]


def test_reference_blas_warns_with_the_fix(tmp_path):
    linux_with_openblas()
    code, checks = doctor("--state-dir", str(tmp_path), preload=False)
    blas = checks["blas"]
    assert code == 0, "a warning is not a failure"
    assert blas["status"] == "warn", blas
    assert not blas["details"]["openblas"] and blas["details"]["gflops"] < 25
    assert "reference BLAS" in blas["message"]
    assert f"LD_PRELOAD={OPENBLAS}" in blas["hint"]
    assert "apt install libopenblas0-pthread" in blas["hint"] and "source ops/env.sh" in blas["hint"]


def test_table_output_shows_fixes(tmp_path):
    linux_with_openblas()
    _, out = doctor("--state-dir", str(tmp_path), preload=False, table=True)
    lines = out.splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "MESSAGE"]
    blas = next(i for i, line in enumerate(lines) if line.startswith("blas "))
    assert lines[blas].split()[1] == "warn"
    assert lines[blas + 1].strip().startswith("fix: apt install libopenblas0-pthread")
    assert "warn" in lines[-1]


def test_models_bigger_than_memory_fail(tmp_path, forged):
    """A real model directory whose weights file is larger than this host's RAM
    (sparse: it takes no disk)."""
    model = tmp_path / "huge"
    model.mkdir()
    shutil.copy(forged / "target" / "config.json", model)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(2 * total)
    directory = tmp_path / "manifests"
    directory.mkdir()
    (directory / "huge.yaml").write_text(model_manifest("huge", model))
    code, checks = doctor("--manifests", str(directory), "--state-dir", str(tmp_path / "state"))
    assert code == 1
    memory = checks["memory"]
    assert memory["status"] == "fail" and "cannot fit" in memory["message"], memory
    assert "Model huge" in memory["hint"]
    assert memory["details"]["needed_bytes"] == 2 * total


def test_hub_models_are_sized_from_the_cache_or_reported_unknown(tmp_path, forged):
    directory = tmp_path / "manifests"
    directory.mkdir()
    (directory / "hub.yaml").write_text(model_manifest("cached", "org/cached-model") + "---\n"
                                        + model_manifest("absent", "org/absent-model"))
    # the service's cache layout: HF_HOME=<state dir>/huggingface
    snapshot = tmp_path / "state/huggingface/hub/models--org--cached-model/snapshots/abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(forged / "target" / "model.safetensors", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs/main").write_text("abc123")
    code, checks = doctor("--manifests", str(directory), "--state-dir", str(tmp_path / "state"),
                          env={"HF_HOME": str(tmp_path / "user-hf")})  # not this machine's own cache
    memory = checks["memory"]
    sizes = {m["name"]: m["bytes"] for m in memory["details"]["models"]}
    assert sizes == {"cached": (forged / "target/model.safetensors").stat().st_size, "absent": None}
    assert memory["status"] == "warn" and "1 of unknown size" in memory["message"]
    assert "org/absent-model" in memory["hint"]
    assert code == 0


def test_unwritable_state_dir_fails(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, checks = doctor("--state-dir", str(blocker / "state"))
    assert code == 1 and checks["state-dir"]["status"] == "fail"
    assert "is not a directory" in checks["state-dir"]["message"]

    if os.geteuid() == 0:  # permissions do not stop root; /proc does
        if sys.platform != "linux":
            return
        readonly = Path("/proc/self")
    else:
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o555)
    for path in (readonly, readonly / "state"):
        code, checks = doctor("--state-dir", str(path))
        assert code == 1 and checks["state-dir"]["status"] == "fail", checks["state-dir"]
        assert checks["state-dir"]["hint"]


def test_invalid_manifest_fails(tmp_path):
    directory = tmp_path / "manifests"
    directory.mkdir()
    (directory / "bad.yaml").write_text(model_manifest("bad", "/nonexistent", maxBatchSize=0))
    code, checks = doctor("--manifests", str(directory), "--state-dir", str(tmp_path))
    assert code == 1
    assert checks["manifests"]["status"] == "fail"
    assert "spec.maxBatchSize" in checks["manifests"]["message"]
    assert checks["memory"]["status"] == "skip"


def test_a_model_whose_request_never_fits_the_node_is_warned_about(tmp_path, forged):
    linux_with_openblas()
    directory = tmp_path / "manifests"
    directory.mkdir()
    (directory / "m.yaml").write_text(model_manifest("vast", forged / "target", prefixCache="{maxBytes: 10Ti}"))
    code, checks = doctor("--manifests", str(directory), "--state-dir", str(tmp_path / "state"), preload=True)
    memory = checks["memory"]
    assert memory["status"] == "warn" and "can never fit" in memory["message"], memory
    assert "vast" in memory["hint"] and "Unschedulable" in memory["hint"]


def test_a_model_asking_for_images_without_mlx_vlm_fails(tmp_path, forged):
    """mlx-vlm hidden from the interpreter (as a host without specd[vision] has it)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nclass Hide:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mlx_vlm' or name.startswith('mlx_vlm.'):\n            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    env = {"PYTHONPATH": f"{hide}:{os.environ.get('PYTHONPATH', '')}"}
    directory = tmp_path / "manifests"
    directory.mkdir()
    (directory / "m.yaml").write_text(model_manifest("eyes", forged / "target", modalities="[text, image]"))
    code, checks = doctor("--manifests", str(directory), "--state-dir", str(tmp_path / "state"), env=env)
    assert code == 1 and checks["vision"]["status"] == "fail" and "eyes" in checks["vision"]["message"]
    (directory / "m.yaml").write_text(model_manifest("plain", forged / "target"))
    code, checks = doctor("--manifests", str(directory), "--state-dir", str(tmp_path / "state"), env=env)
    assert checks["vision"]["status"] == "warn" and "specd[vision]" in checks["vision"]["hint"]
