"""`specd service install|uninstall`: the rendered systemd unit and launchd job.

The systemd files are checked by systemd's own tools (`systemd-analyze verify`
and `security`, `systemd-sysusers`, `systemd-tmpfiles`), without a running
systemd: nothing here starts the service.  Missing tools skip, except under CI.
"""

from __future__ import annotations

import os
import plistlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from specd import service

ROOT = Path(__file__).resolve().parents[2]
SPECD = str(Path(sys.executable).parent / "specd")  # what `service install` picks by default
LINUX_FILES = {service.LINUX_SYSUSERS_PATH, service.LINUX_TMPFILES_PATH, service.LINUX_ENV_FILE,
               service.LINUX_UNIT_PATH}


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is required under CI (ops/test.sh installs it)")
        pytest.skip(f"{tool} is not installed")
    return path


def specd_service(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "specd.cli", "service", *args], check=False,
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})},
                            timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def parse_plan(out: str) -> tuple[dict[str, str], list[str], list[str]]:
    """A dry run's output: (path -> file contents written, commands run, other steps)."""
    files: dict[str, str] = {}
    commands: list[str] = []
    other: list[str] = []
    lines = out.splitlines()
    assert lines[0].startswith("# specd service") and "dry run" in lines[0]
    i = 1
    while i < len(lines):
        line = lines[i]
        assert line.startswith("==> "), line
        i += 1
        if m := re.match(r"==> write (.+) \(mode \d{4}\)$", line):
            block = []
            while i < len(lines) and not lines[i].startswith("==> "):
                block.append(lines[i])
                i += 1
            files[m.group(1)] = "\n".join(block)  # print's newline after the content's: a last ""
        elif line.startswith("==> run "):
            commands.append(line[len("==> run "):])
        else:
            other.append(line)
    return files, commands, other


def verify(unit: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([require("systemd-analyze"), "verify", *extra, str(unit)],
                          check=False, capture_output=True, text=True, timeout=60)


def verify_root(tmp_path: Path, executable: str) -> Path:
    """A root directory for `systemd-analyze --root`: the system's unit files (the
    targets the unit names) and a real executable at ``executable``."""
    root = tmp_path / "root"
    units = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None)
    if units is None:
        pytest.skip("no system unit directory to verify against")
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    exe = root / executable.lstrip("/")
    exe.parent.mkdir(parents=True)
    shutil.copy(SPECD, exe)
    return root


# --------------------------------------------------------------------------- one source of truth


def test_checked_in_files_are_the_renderers_output():
    for rel, content in service.checked_in_files().items():
        assert (ROOT / rel).read_text() == content, (
            f"{rel} differs from specd.service's rendering: edit specd/service.py, then "
            "`python -m specd.service .` rewrites the checked-in copies")


def test_stop_timeouts_cover_the_drain_grace():
    for drain in (30.0, 90.0, 2.5):
        linux = service.ServiceConfig("linux", SPECD, "/var/lib/specd", "/etc/specd/manifests",
                                      drain_grace=drain, user="specd", env_file="/etc/specd/specd.env")
        unit = service.render_unit(linux)
        timeout = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE).group(1))
        assert timeout >= drain + 10
        assert f"--drain-grace {drain:g}" in unit
        darwin = service.ServiceConfig("darwin", SPECD, "/s", "/m", drain_grace=drain, log_file="/l/specd.log")
        plist = plistlib.loads(service.render_plist(darwin).encode())
        assert plist["ExitTimeOut"] >= drain + 10
        assert plist["ProgramArguments"][-2:] == ["--drain-grace", f"{drain:g}"]


def test_rendered_command_lines_are_what_specd_daemon_accepts():
    """ExecStart (after systemd's variable expansion, with the unit's defaults)
    and ProgramArguments parse with the real `specd` parser."""
    from specd.cli import build_parser

    unit = service.render_unit(service.default_config("linux"))
    exec_start = re.search(r"^ExecStart=((?:.*\\\n)*.*)$", unit, re.MULTILINE).group(1)
    exec_start = exec_start.replace("\\\n", " ").replace("${SPECD_LOG_LEVEL}", "info").replace("$SPECD_OPTS", "")
    argv = shlex.split(exec_start)
    assert argv[0] == service.DEFAULT_EXECUTABLE
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.log_level, args.port, args.host, args.drain_grace) == \
        ("daemon", "info", 8000, "127.0.0.1", 30.0)
    assert (args.state_dir, args.manifests) == (Path("/var/lib/specd"), Path("/etc/specd/manifests"))

    plist = plistlib.loads(service.render_plist(service.default_config("darwin")).encode())
    args = build_parser().parse_args(plist["ProgramArguments"][1:])
    assert args.state_dir == Path("/Library/Application Support/specd")


# --------------------------------------------------------------------------- dry runs


def test_linux_dry_run_prints_everything_and_changes_nothing(tmp_path):
    before = {p: Path(p).exists() for p in LINUX_FILES}
    out = specd_service("install", "--dry-run", "--platform", "linux", "--port", "8123").stdout
    files, commands, other = parse_plan(out)
    assert set(files) | {line.split()[2] for line in other if line.startswith("==> keep ")} == LINUX_FILES
    assert {p: Path(p).exists() for p in LINUX_FILES} == before, "a dry run wrote a file"
    assert commands == ["systemd-sysusers /etc/sysusers.d/specd.conf",
                        "systemd-tmpfiles --create /etc/tmpfiles.d/specd.conf",
                        "systemctl daemon-reload", "systemctl enable specd", "systemctl restart specd"]
    unit = files[service.LINUX_UNIT_PATH]
    assert f"ExecStart={SPECD} --log-level ${{SPECD_LOG_LEVEL}} daemon" in unit
    for line in ("User=specd", "StateDirectory=specd", "ReadWritePaths=/var/lib/specd", "Type=exec",
                 "Restart=on-failure", "KillSignal=SIGTERM", "TimeoutStopSec=60", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes",
                 "EnvironmentFile=-/etc/specd/specd.env", "    --port 8123 \\", "    $SPECD_OPTS"):
        assert line in unit.splitlines(), line
    assert 'u specd - "specd LLM serving daemon" /var/lib/specd /usr/sbin/nologin' in \
        files[service.LINUX_SYSUSERS_PATH]
    if service.LINUX_ENV_FILE in files and Path(service.openblas_path()).exists():
        # this host has OpenBLAS: the service preloads it
        assert f"\nLD_PRELOAD={service.openblas_path()}\nOPENBLAS_THREAD_TIMEOUT=4\n" in files[service.LINUX_ENV_FILE]


def test_linux_dry_run_unit_passes_systemd_analyze_verify(tmp_path):
    """The unit as installed here (ExecStart is this venv's real specd, which
    verify checks is executable).  systemd 252's verify does not look users
    up, so User=specd needs no such user on this machine."""
    files, _, _ = parse_plan(specd_service("install", "--dry-run", "--platform", "linux").stdout)
    unit = tmp_path / "specd.service"
    unit.write_text(files[service.LINUX_UNIT_PATH])
    result = verify(unit)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr
    # verify is not vacuous: an unknown key and a missing executable are reported
    broken = tmp_path / "broken" / "specd.service"
    broken.parent.mkdir()
    broken.write_text(files[service.LINUX_UNIT_PATH].replace(SPECD, "/nonexistent/specd")
                      .replace("NoNewPrivileges=yes", "NoNewPrivileges=yes\nNoSuchKey=1"))
    result = verify(broken)
    assert result.returncode != 0 and "/nonexistent/specd" in result.stderr
    assert "NoSuchKey" in result.stderr


def test_checked_in_unit_passes_verify_and_is_hardened(tmp_path):
    """The checked-in unit names /opt/specd/bin/specd: verify it in a root
    directory holding the system's units and a real executable there."""
    root = verify_root(tmp_path, service.DEFAULT_EXECUTABLE)
    target = root / "etc/systemd/system/specd.service"
    target.parent.mkdir(parents=True)
    shutil.copy(ROOT / "systemd/specd.service", target)
    result = verify(Path("/etc/systemd/system/specd.service"), f"--root={root}")
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr
    security = subprocess.run([require("systemd-analyze"), "security", "--offline=yes", f"--root={root}",
                               "specd.service"], check=False, capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for specd\.service: ([\d.]+)", security.stdout)
    assert m, security.stdout + security.stderr
    # 10 is an unhardened unit; 1.5 when written.  A dropped setting shows here.
    assert float(m.group(1)) <= 2.5, security.stdout


def test_sysusers_and_tmpfiles_create_the_user_and_directories(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles chowns the state dir: needs root")
    sysusers, tmpfiles = require("systemd-sysusers"), require("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([sysusers, f"--root={root}", str(ROOT / "systemd/specd.sysusers.conf")],
                   check=True, capture_output=True, timeout=60)
    entry = next(line for line in (root / "etc/passwd").read_text().splitlines() if line.startswith("specd:"))
    _, _, uid, _, _, home, shell = entry.split(":")
    assert (home, shell) == ("/var/lib/specd", "/usr/sbin/nologin") and int(uid) < 1000
    subprocess.run([tmpfiles, f"--root={root}", "--create", str(ROOT / "systemd/specd.tmpfiles.conf")],
                   check=True, capture_output=True, timeout=60)
    state = (root / "var/lib/specd").stat()
    assert state.st_uid == int(uid) and stat.S_IMODE(state.st_mode) == 0o750
    assert stat.S_IMODE((root / "etc/specd/manifests").stat().st_mode) == 0o755


@pytest.mark.parametrize("scope", ["user", "system"])
def test_darwin_dry_run_renders_a_launchd_job(tmp_path, scope):
    home = tmp_path / "home"
    home.mkdir()
    out = specd_service("install", "--dry-run", "--platform", "darwin", "--scope", scope,
                        env={"HOME": str(home), "SUDO_USER": ""}).stdout
    files, commands, other = parse_plan(out)
    assert list(home.iterdir()) == [], "a dry run wrote a file"
    base = str(home) if scope == "user" else ""
    path = (f"{home}/Library/LaunchAgents/dev.specd.daemon.plist" if scope == "user"
            else "/Library/LaunchDaemons/dev.specd.daemon.plist")
    assert list(files) == [path]
    plist = plistlib.loads(files[path].encode())
    for key in ("Label", "ProgramArguments", "KeepAlive", "RunAtLoad", "StandardOutPath",
                "StandardErrorPath", "WorkingDirectory", "EnvironmentVariables"):
        assert key in plist, key
    state = f"{base}/Library/Application Support/specd"
    assert plist["Label"] == "dev.specd.daemon"
    assert plist["ProgramArguments"] == [SPECD, "daemon", "--manifests", f"{state}/manifests",
                                         "--state-dir", state, "--host", "127.0.0.1", "--port", "8000",
                                         "--drain-grace", "30"]
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["WorkingDirectory"] == state
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == f"{base}/Library/Logs/specd/specd.log"
    assert plist["ExitTimeOut"] > 30
    assert ("HF_HOME" in plist["EnvironmentVariables"]) == (scope == "system")
    domain = "system" if scope == "system" else f"gui/{os.getuid()}"
    assert commands == [f"launchctl bootout {domain}/dev.specd.daemon (a failure is ignored)",
                        f"launchctl enable {domain}/dev.specd.daemon",
                        f"launchctl bootstrap {domain} {path}"]
    assert any(line.startswith("==> mkdir -p") and "Logs/specd" in line for line in other)


def test_uninstall_dry_run(tmp_path):
    files, commands, other = parse_plan(specd_service("uninstall", "--dry-run", "--platform", "linux").stdout)
    assert files == {}
    assert commands == ["systemctl disable --now specd (a failure is ignored)", "systemctl daemon-reload"]
    assert [line for line in other if line.startswith("==> remove")] == [
        f"==> remove {p}" for p in (service.LINUX_UNIT_PATH, service.LINUX_SYSUSERS_PATH,
                                    service.LINUX_TMPFILES_PATH)]
    files, commands, _ = parse_plan(specd_service("uninstall", "--dry-run", "--platform", "darwin",
                                                  "--scope", "system").stdout)
    assert commands == ["launchctl bootout system/dev.specd.daemon (a failure is ignored)"]


# --------------------------------------------------------------------------- real runs under --root


def test_install_and_uninstall_under_a_root_directory(tmp_path):
    root = tmp_path / "root"
    args = ["--platform", "linux", "--root", str(root)]
    dry, _, _ = parse_plan(specd_service("install", "--dry-run", *args).stdout)
    result = specd_service("install", *args)
    assert "skipped (--root): systemctl daemon-reload" in result.stdout
    for path in LINUX_FILES:
        assert (root / path.lstrip("/")).read_text() == dry[path]
    env = root / service.LINUX_ENV_FILE.lstrip("/")
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert stat.S_IMODE((root / service.LINUX_UNIT_PATH.lstrip("/")).stat().st_mode) == 0o644
    unit = root / service.LINUX_UNIT_PATH.lstrip("/")
    result = verify(unit)  # ExecStart is this venv's specd
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr

    # a re-install (an upgrade) rewrites the unit but keeps the edited environment file
    env.write_text("SPECD_LOG_LEVEL=debug\n")
    out = specd_service("install", "--port", "9000", *args).stdout
    assert f"kept {env}" in out
    assert env.read_text() == "SPECD_LOG_LEVEL=debug\n"
    assert "    --port 9000 \\" in unit.read_text().splitlines()
    assert "==> keep /etc/specd/specd.env" in specd_service("install", "--dry-run", *args).stdout

    specd_service("uninstall", *args)
    for path in LINUX_FILES - {service.LINUX_ENV_FILE}:
        assert not (root / path.lstrip("/")).exists(), path
    assert env.exists(), "uninstall keeps the environment file"


def test_darwin_install_under_a_root_directory(tmp_path):
    root = tmp_path / "root"
    specd_service("install", "--platform", "darwin", "--scope", "system", "--root", str(root))
    plist = plistlib.loads((root / "Library/LaunchDaemons/dev.specd.daemon.plist").read_bytes())
    assert plist["ProgramArguments"][0] == SPECD
    assert (root / "Library/Application Support/specd/manifests").is_dir()
    assert (root / "Library/Logs/specd").is_dir()
    specd_service("uninstall", "--platform", "darwin", "--scope", "system", "--root", str(root))
    assert not (root / "Library/LaunchDaemons/dev.specd.daemon.plist").exists()


def test_linux_paths_with_whitespace_are_refused():
    result = specd_service("install", "--dry-run", "--platform", "linux", "--state-dir", "/srv/a b", check=False)
    assert result.returncode == 1 and "whitespace" in result.stderr


def test_real_install_refuses_another_platform():
    other = "darwin" if sys.platform != "darwin" else "linux"
    result = specd_service("install", "--platform", other, check=False)
    assert result.returncode == 1
    assert "only --dry-run or --root DIR" in result.stderr
