"""``specd service install|uninstall``: run the daemon as a system service.

Linux gets a systemd unit (plus sysusers.d and tmpfiles.d entries for the
unprivileged ``specd`` user and its directories, and an EnvironmentFile);
macOS gets a launchd property list.  Every file is rendered here, in code:
the copies checked in under ``systemd/`` and ``launchd/`` are this module's
output for :func:`default_config` (``python -m specd.service DIR`` rewrites
them, and a test keeps them from drifting), so an installed package needs no
data files.

An install is a plan of steps (write a file, make a directory, run a
command) that ``--dry-run`` prints instead of carrying out, and ``--root DIR``
carries out under ``DIR`` without running any command (for packagers).
"""

from __future__ import annotations

import argparse
import os
import platform as _platform
import plistlib
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

LAUNCHD_LABEL = "dev.specd.daemon"
DEFAULT_EXECUTABLE = "/opt/specd/bin/specd"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_DRAIN_GRACE = 30.0  # `specd daemon --drain-grace`'s default
STOP_MARGIN = 30  # seconds the service manager waits beyond the drain grace before SIGKILL
INVALID_MANIFEST_EXIT = 2  # `specd daemon` refuses an invalid manifest with this status

LINUX_UNIT_PATH = "/etc/systemd/system/specd.service"
LINUX_SYSUSERS_PATH = "/etc/sysusers.d/specd.conf"
LINUX_TMPFILES_PATH = "/etc/tmpfiles.d/specd.conf"
LINUX_ENV_FILE = "/etc/specd/specd.env"
LINUX_MANIFESTS = "/etc/specd/manifests"
LINUX_STATE_DIR = "/var/lib/specd"
LINUX_USER = "specd"

DARWIN_SYSTEM_PLIST_DIR = "/Library/LaunchDaemons"
DARWIN_AGENT_PLIST_DIR = "Library/LaunchAgents"  # under the user's home
LAUNCHD_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
OPENBLAS_THREAD_TIMEOUT = 4  # OpenBLAS's shortest spin before an idle worker sleeps: 2**4 cycles


def openblas_path(machine: str | None = None) -> str:
    """Debian's pthread OpenBLAS, which replaces the reference BLAS the Linux
    ``mlx[cpu]`` wheel links when preloaded."""
    machine = machine or _platform.machine() or "x86_64"
    return f"/usr/lib/{machine}-linux-gnu/openblas-pthread/libblas.so.3"


@dataclass(frozen=True)
class ServiceConfig:
    """Everything a rendered service file depends on."""

    platform: str  # "linux" or "darwin"
    executable: str
    state_dir: str
    manifests: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    drain_grace: float = DEFAULT_DRAIN_GRACE
    user: str | None = None  # systemd User= / launchd UserName (None: launchd's default)
    env_file: str | None = None  # Linux: the EnvironmentFile
    log_file: str | None = None  # macOS: StandardOutPath and StandardErrorPath
    hf_home: str | None = None  # Hugging Face cache for hub models (None: the user's own)
    scope: str = "system"  # macOS: "system" (LaunchDaemon) or "user" (LaunchAgent)
    home: str = "~"  # macOS user scope: the home the LaunchAgent lives under
    openblas: str = field(default_factory=lambda: openblas_path("x86_64"))
    preload_openblas: bool = False  # Linux: LD_PRELOAD active (True) or commented (False)

    @property
    def stop_timeout(self) -> int:
        return int(self.drain_grace) + STOP_MARGIN

    def daemon_args(self) -> list[str]:
        grace = int(self.drain_grace) if float(self.drain_grace).is_integer() else self.drain_grace
        return ["daemon", "--manifests", self.manifests, "--state-dir", self.state_dir,
                "--host", self.host, "--port", str(self.port), "--drain-grace", str(grace)]


def darwin_dirs(scope: str, home: str) -> tuple[str, str, str]:
    """(state dir, manifests dir, log file) for a LaunchDaemon or a LaunchAgent."""
    base = "" if scope == "system" else home.rstrip("/")
    state = f"{base}/Library/Application Support/specd"
    return state, f"{state}/manifests", f"{base}/Library/Logs/specd/specd.log"


def default_config(platform: str, scope: str = "system", home: str = "~") -> ServiceConfig:
    """The parameters the checked-in files are rendered with (``scope`` and
    ``home`` only matter on macOS)."""
    if platform == "linux":
        return ServiceConfig("linux", DEFAULT_EXECUTABLE, LINUX_STATE_DIR, LINUX_MANIFESTS,
                             user=LINUX_USER, env_file=LINUX_ENV_FILE,
                             hf_home=f"{LINUX_STATE_DIR}/huggingface")
    if platform == "darwin":
        state, manifests, log_file = darwin_dirs(scope, home)
        return ServiceConfig("darwin", DEFAULT_EXECUTABLE, state, manifests, log_file=log_file,
                             hf_home=f"{state}/huggingface" if scope == "system" else None,
                             scope=scope, home=home)
    raise ValueError(f"unknown platform {platform!r} (linux or darwin)")


# --------------------------------------------------------------------------- rendering


def _systemd_quote(arg: str) -> str:
    """One ExecStart= argument: quoted when it has spaces, quotes or specifiers."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if any(c in arg for c in " \t\"'\\;") or not arg:
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def render_unit(cfg: ServiceConfig) -> str:
    """The systemd unit."""
    exe, *args = [_systemd_quote(a) for a in [cfg.executable, *cfg.daemon_args()]]
    pairs = [args[i:i + 2] for i in range(1, len(args), 2)]
    exec_lines = [f"ExecStart={exe} --log-level ${{SPECD_LOG_LEVEL}} {args[0]}"]
    exec_lines += [" ".join(p) for p in pairs] + ["$SPECD_OPTS"]
    exec_start = " \\\n    ".join(exec_lines)
    env = ["SPECD_LOG_LEVEL=info", "PYTHONUNBUFFERED=1"]
    if cfg.hf_home:
        env.append(f"HF_HOME={cfg.hf_home}")
    state = cfg.state_dir.rstrip("/")
    under_var_lib = state.startswith("/var/lib/") and state.count("/") >= 3
    state_lines = ([f"StateDirectory={state[len('/var/lib/'):]}", "StateDirectoryMode=0750"]
                   if under_var_lib else [])
    user_lines = [f"User={cfg.user}"] if cfg.user else []
    env_file_lines = [f"EnvironmentFile=-{cfg.env_file}"] if cfg.env_file else []
    return "\n".join([
        "# specd: declarative LLM serving daemon.",
        "# Rendered by `specd service install`, which overwrites it: put settings in",
        f"# {cfg.env_file or 'an EnvironmentFile'} or a drop-in (`systemctl edit specd`).",
        "[Unit]",
        "Description=specd LLM serving daemon",
        "Wants=network-online.target",
        "After=network-online.target",
        "StartLimitIntervalSec=300",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=exec",
        *user_lines,
        f"Environment={' '.join(env)}",
        *env_file_lines,
        exec_start,
        f"WorkingDirectory={state}",
        *state_lines,
        f"ReadWritePaths={state}",
        "Restart=on-failure",
        "RestartSec=5",
        "# an invalid manifest: restarting cannot help",
        f"RestartPreventExitStatus={INVALID_MANIFEST_EXIT}",
        f"# SIGTERM drains in-flight requests for --drain-grace ({cfg.drain_grace:g} s), then exits 0",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={cfg.stop_timeout}",
        "UMask=0027",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "PrivateTmp=yes",
        "# a GPU host (mlx[cuda]) needs its /dev/nvidia*: drop PrivateDevices there",
        "PrivateDevices=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "PrivateMounts=yes",
        "CapabilityBoundingSet=",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def render_sysusers(cfg: ServiceConfig) -> str:
    return (f"# The unprivileged user the specd service runs as (sysusers.d(5)).\n"
            f'u {cfg.user} - "specd LLM serving daemon" {cfg.state_dir} /usr/sbin/nologin\n')


def render_tmpfiles(cfg: ServiceConfig) -> str:
    lines = ["# specd's directories (tmpfiles.d(5)): configuration and manifests are root's,",
             "# readable by the service; the state directory (SQLite store, hub cache) is the service user's."]
    conf_dirs = []
    for path in (cfg.env_file and str(Path(cfg.env_file).parent), cfg.manifests):
        if path and path not in conf_dirs:
            conf_dirs.append(path)
    lines += [f"d {p} 0755 root root -" for p in conf_dirs]
    lines.append(f"d {cfg.state_dir} 0750 {cfg.user or 'root'} - -")
    return "\n".join(lines) + "\n"


def render_env(cfg: ServiceConfig) -> str:
    preload = f"LD_PRELOAD={cfg.openblas}"
    timeout = f"OPENBLAS_THREAD_TIMEOUT={OPENBLAS_THREAD_TIMEOUT}"
    hf_home = cfg.hf_home or f"{cfg.state_dir}/huggingface"
    return "\n".join([
        "# Environment of the specd service (systemd EnvironmentFile, read at every start;",
        "# `specd service install` keeps an existing copy).  Apply changes: systemctl restart specd",
        "",
        "# Linux CPU hosts: preload OpenBLAS.  The mlx[cpu] wheel links the reference BLAS",
        "# (float32 matmul ~3 GFLOP/s; OpenBLAS ~100+).  Needs `apt install libopenblas0-pthread`;",
        "# `specd doctor` checks it.  Its idle worker threads then sleep within 2^4 cycles rather",
        "# than spin for 2^28 on the cores MLX's CPU streams attend on (core/kv.py).",
        preload if cfg.preload_openblas else f"#{preload}",
        timeout if cfg.preload_openblas else f"#{timeout}",
        "",
        "# Log level: debug, info, warning or error (JSON lines, in the journal).",
        "#SPECD_LOG_LEVEL=info",
        "",
        "# More `specd daemon` options, after the unit's own (a repeated option wins), e.g.",
        "# an admin token for non-loopback admin clients (a file the service user can read):",
        "#SPECD_OPTS=--admin-token-file /etc/specd/admin-token",
        f"# Keep --drain-grace below TimeoutStopSec ({cfg.stop_timeout} s) minus a few seconds.",
        "",
        "# Hugging Face: where hub models are cached, and a token for gated repositories.",
        f"#HF_HOME={hf_home}",
        "#HF_TOKEN=",
        "",
    ])


def plist_dict(cfg: ServiceConfig) -> dict:
    env = {"PATH": f"{Path(cfg.executable).parent}:{LAUNCHD_PATH}", "PYTHONUNBUFFERED": "1"}
    if cfg.hf_home:
        env["HF_HOME"] = cfg.hf_home
    plist = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": [cfg.executable, *cfg.daemon_args()],
        "EnvironmentVariables": env,
        "WorkingDirectory": cfg.state_dir,
        "RunAtLoad": True,
        # restarted unless it exits 0 (a drained SIGTERM), as systemd's Restart=on-failure
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 5,
        # launchd's SIGTERM-to-SIGKILL wait (default 20 s) must cover the drain grace
        "ExitTimeOut": cfg.stop_timeout,
        "StandardOutPath": cfg.log_file,
        "StandardErrorPath": cfg.log_file,
    }
    if cfg.user:
        plist["UserName"] = cfg.user
    return plist


def render_plist(cfg: ServiceConfig) -> str:
    return plistlib.dumps(plist_dict(cfg), sort_keys=True).decode()


# --------------------------------------------------------------------------- where files go


def linux_files(cfg: ServiceConfig) -> dict[str, str]:
    """Installed path -> contents, in install order."""
    files = {LINUX_SYSUSERS_PATH: render_sysusers(cfg), LINUX_TMPFILES_PATH: render_tmpfiles(cfg)}
    if cfg.env_file:
        files[cfg.env_file] = render_env(cfg)
    files[LINUX_UNIT_PATH] = render_unit(cfg)
    return files


def plist_path(cfg: ServiceConfig) -> str:
    directory = (DARWIN_SYSTEM_PLIST_DIR if cfg.scope == "system"
                 else f"{cfg.home.rstrip('/')}/{DARWIN_AGENT_PLIST_DIR}")
    return f"{directory}/{LAUNCHD_LABEL}.plist"


def checked_in_files() -> dict[str, str]:
    """Repository path -> contents of the reference copies under systemd/ and launchd/."""
    linux = default_config("linux")
    return {
        "systemd/specd.service": render_unit(linux),
        "systemd/specd.sysusers.conf": render_sysusers(linux),
        "systemd/specd.tmpfiles.conf": render_tmpfiles(linux),
        "systemd/specd.env": render_env(linux),
        f"launchd/{LAUNCHD_LABEL}.plist": render_plist(default_config("darwin")),
    }


# --------------------------------------------------------------------------- plans


class ServiceError(Exception):
    """A failure reported as one line and exit status 1."""


@dataclass(frozen=True)
class Write:
    path: str
    content: str
    mode: int = 0o644
    keep_existing: bool = False  # a configuration file the user may have edited


@dataclass(frozen=True)
class MakeDir:
    path: str
    owner: str | None = None


@dataclass(frozen=True)
class Remove:
    path: str


@dataclass(frozen=True)
class Run:
    argv: list[str]
    check: bool = True  # False: a failure is reported and ignored


@dataclass(frozen=True)
class Note:
    text: str


Step = Write | MakeDir | Remove | Run | Note


def _launchd_domain(cfg: ServiceConfig) -> str:
    return "system" if cfg.scope == "system" else f"gui/{os.getuid()}"


def install_plan(cfg: ServiceConfig, start: bool = True) -> list[Step]:
    if cfg.platform == "linux":
        files = linux_files(cfg)
        steps: list[Step] = [
            Write(LINUX_SYSUSERS_PATH, files[LINUX_SYSUSERS_PATH]),
            Run(["systemd-sysusers", LINUX_SYSUSERS_PATH]),
            Write(LINUX_TMPFILES_PATH, files[LINUX_TMPFILES_PATH]),
            Run(["systemd-tmpfiles", "--create", LINUX_TMPFILES_PATH]),
        ]
        if cfg.env_file:
            steps.append(Write(cfg.env_file, files[cfg.env_file], mode=0o600, keep_existing=True))
        steps += [Write(LINUX_UNIT_PATH, files[LINUX_UNIT_PATH]),
                  Run(["systemctl", "daemon-reload"]),
                  Run(["systemctl", "enable", "specd"])]
        # restart, not start: a re-install (an upgrade) must replace the running daemon
        steps.append(Run(["systemctl", "restart", "specd"]) if start
                     else Note("not started (--no-start): systemctl start specd"))
        steps.append(Note(f"manifests: {cfg.manifests}; state: {cfg.state_dir}; "
                          "logs: journalctl -u specd"))
        if cfg.executable.startswith(("/root/", "/home/")):
            steps.append(Note(f"{cfg.executable} is in a home directory: the {cfg.user} user must be able "
                              "to read it and its Python environment (a venv under /opt/specd is simpler)"))
        return steps
    path = plist_path(cfg)
    owner = cfg.user if cfg.scope == "system" else None
    domain = _launchd_domain(cfg)
    steps = [MakeDir(cfg.state_dir, owner), MakeDir(cfg.manifests, owner)]
    if cfg.log_file:
        steps.append(MakeDir(str(Path(cfg.log_file).parent), owner))
    steps += [MakeDir(str(Path(path).parent)), Write(path, render_plist(cfg))]
    if start:
        steps += [Run(["launchctl", "bootout", f"{domain}/{LAUNCHD_LABEL}"], check=False),
                  Run(["launchctl", "enable", f"{domain}/{LAUNCHD_LABEL}"]),
                  Run(["launchctl", "bootstrap", domain, path])]
    else:
        steps.append(Note(f"not started (--no-start): launchctl bootstrap {domain} {shlex.quote(path)}"))
    steps.append(Note(f"manifests: {cfg.manifests}; state: {cfg.state_dir}; logs: {cfg.log_file}"))
    return steps


def uninstall_plan(cfg: ServiceConfig) -> list[Step]:
    if cfg.platform == "linux":
        return [Run(["systemctl", "disable", "--now", "specd"], check=False),
                Remove(LINUX_UNIT_PATH), Remove(LINUX_SYSUSERS_PATH), Remove(LINUX_TMPFILES_PATH),
                Run(["systemctl", "daemon-reload"]),
                Note(f"kept: {cfg.env_file}, {cfg.manifests}, {cfg.state_dir} and the {cfg.user} user "
                     f"(remove them by hand: rm -r {cfg.state_dir}; userdel {cfg.user})")]
    domain = _launchd_domain(cfg)
    return [Run(["launchctl", "bootout", f"{domain}/{LAUNCHD_LABEL}"], check=False),
            Remove(plist_path(cfg)),
            Note(f"kept: {cfg.manifests}, {cfg.state_dir} and {cfg.log_file} (remove them by hand)")]


def _under(root: Path | None, path: str) -> Path:
    return Path(path) if root is None else root / path.lstrip("/")


def describe(step: Step, root: Path | None = None) -> str:
    """How ``--dry-run`` shows a step (file contents follow a write's header verbatim)."""
    if isinstance(step, Write):
        if step.keep_existing and _under(root, step.path).exists():
            return f"==> keep {step.path} (it exists; not overwritten)"
        return f"==> write {step.path} (mode {step.mode:04o})\n{step.content}"
    if isinstance(step, MakeDir):
        return f"==> mkdir -p {shlex.quote(step.path)}" + (f" (owner {step.owner})" if step.owner else "")
    if isinstance(step, Remove):
        return f"==> remove {step.path}"
    if isinstance(step, Run):
        return f"==> run {shlex.join(step.argv)}" + ("" if step.check else " (a failure is ignored)")
    return f"==> note: {step.text}"


def execute(steps: list[Step], root: Path | None = None, out: Callable[[str], None] = print) -> None:
    """Carry out a plan; under ``root`` nothing is run.  Raises ServiceError on a failed step."""
    for step in steps:
        if isinstance(step, Write):
            target = _under(root, step.path)
            if step.keep_existing and target.exists():
                out(f"kept {target} (exists)")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".specd-new")
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, step.mode)  # never wider than mode
            with os.fdopen(fd, "w") as f:
                f.write(step.content)
            tmp.chmod(step.mode)  # whatever the umask
            tmp.replace(target)
            out(f"wrote {target}")
        elif isinstance(step, MakeDir):
            target = _under(root, step.path)
            target.mkdir(parents=True, exist_ok=True)
            if step.owner and root is None:
                shutil.chown(target, step.owner)
            out(f"made {target}")
        elif isinstance(step, Remove):
            target = _under(root, step.path)
            if target.exists():
                target.unlink()
                out(f"removed {target}")
        elif isinstance(step, Run):
            if root is not None:
                out(f"skipped (--root): {shlex.join(step.argv)}")
                continue
            out(f"running {shlex.join(step.argv)}")
            try:
                code = subprocess.run(step.argv, check=False).returncode
            except FileNotFoundError:
                code = 127
            if code != 0:
                if step.check:
                    raise ServiceError(f"{shlex.join(step.argv)} exited with {code}")
                out(f"({shlex.join(step.argv)} exited with {code}; ignored)")
        else:
            out(step.text)


# --------------------------------------------------------------------------- the command


def current_platform() -> str:
    return "darwin" if sys.platform == "darwin" else "linux"


def default_executable() -> str:
    """The ``specd`` next to this interpreter (a venv's bin/), else the one on PATH."""
    beside = Path(sys.executable).parent / "specd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.absolute())
    found = shutil.which("specd")
    if found:
        return str(Path(found).absolute())
    raise ServiceError("cannot find the specd executable next to "
                       f"{sys.executable} or on PATH; pass --executable")


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    platform = args.platform or current_platform()
    scope = getattr(args, "scope", None) or ("system" if os.geteuid() == 0 else "user")
    if platform == "linux":
        scope = "system"
    cfg = default_config(platform, scope=scope, home=str(Path.home()))
    if args.action != "install":  # uninstall needs only the fixed paths
        return cfg
    changes: dict = {"host": args.host, "port": args.port, "drain_grace": args.drain_grace,
                     "executable": args.executable or default_executable()}
    for name in ("state_dir", "manifests"):
        if getattr(args, name):
            changes[name] = str(Path(getattr(args, name)).absolute())
    if platform == "linux":
        changes["user"] = args.user or LINUX_USER
        if args.env_file:
            changes["env_file"] = str(Path(args.env_file).absolute())
        if args.state_dir:
            changes["hf_home"] = f"{changes['state_dir']}/huggingface"
        if current_platform() == "linux":
            changes["openblas"] = openblas_path()
            changes["preload_openblas"] = Path(changes["openblas"]).exists()
    else:
        sudo_user = os.environ.get("SUDO_USER") or None
        user = args.user or (sudo_user if scope == "system" and sudo_user != "root" else None)
        changes["user"] = user if scope == "system" else None
        if args.log_file:
            changes["log_file"] = str(Path(args.log_file).absolute())
        if args.state_dir and scope == "system":
            changes["hf_home"] = f"{changes['state_dir']}/huggingface"
    cfg = replace(cfg, **changes)
    if platform == "linux":
        for path in (cfg.executable, cfg.state_dir, cfg.manifests, cfg.env_file or ""):
            if any(c.isspace() for c in path):
                raise ServiceError(f"{path!r}: paths with whitespace are not supported in "
                                   "systemd's space-separated settings")
    return cfg


def _check_can_run(cfg: ServiceConfig, args: argparse.Namespace) -> None:
    if args.dry_run or args.root is not None:
        return
    if cfg.platform != current_platform():
        raise ServiceError(f"--platform {cfg.platform} on {current_platform()}: "
                           "only --dry-run or --root DIR can render another platform's files")
    if cfg.scope == "system" and os.geteuid() != 0:
        raise ServiceError("installing a system service needs root: run it with sudo "
                           "(or see what it would do with --dry-run)")


def run_command(args: argparse.Namespace) -> int:
    try:
        if args.scope and (args.platform or current_platform()) == "linux":
            raise ServiceError("--scope applies to macOS; on Linux the unit is a system service")
        cfg = config_from_args(args)
        if cfg.platform == "darwin" and args.action == "install" and cfg.scope == "user" and args.user:
            raise ServiceError("--user applies to a system LaunchDaemon (--scope system), "
                               "a LaunchAgent runs as its own user")
        _check_can_run(cfg, args)
        steps = (install_plan(cfg, start=not args.no_start) if args.action == "install"
                 else uninstall_plan(cfg))
        root = Path(args.root).absolute() if args.root is not None else None
        if args.dry_run:
            where = f" under {root}" if root else ""
            print(f"# specd service {args.action} --platform {cfg.platform} (dry run: nothing is "
                  f"written or run{where})")
            for step in steps:
                print(describe(step, root))
            return 0
        execute(steps, root)
        return 0
    except ServiceError as err:
        print(f"specd service: {err}", file=sys.stderr)
        return 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    service = sub.add_parser("service", help="install or uninstall the daemon as a system service")
    actions = service.add_subparsers(dest="action", required=True)
    for action in ("install", "uninstall"):
        p = actions.add_parser(action, help=f"{action} the systemd unit (Linux) or launchd job (macOS)")
        p.add_argument("--dry-run", action="store_true",
                       help="print every file it would write and every command it would run; change nothing")
        p.add_argument("--platform", choices=("linux", "darwin"), default=None,
                       help="render for this platform (default: this machine's)")
        p.add_argument("--scope", choices=("system", "user"), default=None,
                       help="macOS: a LaunchDaemon (system; the default as root) or a "
                            "LaunchAgent in ~/Library/LaunchAgents (user; the default otherwise)")
        p.add_argument("--root", type=Path, default=None,
                       help="write the files under this directory and run no command (packaging)")
        if action == "install":
            p.add_argument("--executable", default=None,
                           help="the specd executable (default: the one next to this Python, else PATH)")
            p.add_argument("--state-dir", default=None, help="the daemon's --state-dir")
            p.add_argument("--manifests", default=None, help="the daemon's --manifests directory")
            p.add_argument("--host", default=DEFAULT_HOST)
            p.add_argument("--port", type=int, default=DEFAULT_PORT)
            p.add_argument("--drain-grace", type=float, default=DEFAULT_DRAIN_GRACE,
                           help="the daemon's --drain-grace; the stop timeout is this plus "
                                f"{STOP_MARGIN} s")
            p.add_argument("--user", default=None,
                           help=f"the user it runs as (Linux default: {LINUX_USER}, created with "
                                "systemd-sysusers; macOS LaunchDaemon default: $SUDO_USER)")
            p.add_argument("--env-file", default=None,
                           help=f"Linux: the EnvironmentFile (default: {LINUX_ENV_FILE})")
            p.add_argument("--log-file", default=None,
                           help="macOS: stdout/stderr log (default: Library/Logs/specd/specd.log)")
            p.add_argument("--no-start", action="store_true", help="install and enable, but do not start")
        p.set_defaults(func=run_command)


def write_checked_in(repo: Path) -> None:
    """Rewrite the reference copies under ``repo`` (``python -m specd.service REPO``)."""
    for rel, content in checked_in_files().items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        print(f"wrote {path}")


if __name__ == "__main__":
    write_checked_in(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
