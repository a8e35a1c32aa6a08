"""The ``specd`` command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Callable

import structlog

from . import logs
from .serving.routing import POLICIES

log = structlog.get_logger("specd")


def _daemon(args: argparse.Namespace) -> int:
    from .api.manifest import ManifestError, load_manifest_dir

    if args.manifests is not None:
        try:
            load_manifest_dir(args.manifests)  # refuse to start on an invalid file
        except ManifestError as err:
            print(f"specd: invalid manifest: {err}", file=sys.stderr)
            return 2
    token = None
    if args.join is not None and args.token_file is None:
        print("specd: --join needs --token-file (the cluster token the head was started with)", file=sys.stderr)
        return 2
    for attr in ("admin_token_file", "cluster_token_file", "token_file"):
        path = getattr(args, attr)
        if path is not None and not path.read_text().strip():
            print(f"specd: {path} is empty", file=sys.stderr)
            return 2
    if args.admin_token_file is not None:
        token = args.admin_token_file.read_text().strip()
    if args.join is not None:  # a worker takes control only from its head, which holds the cluster token
        from .serving.tls import JoinToken, TokenError

        try:
            args.join_token = JoinToken.parse(args.token_file.read_text())
        except TokenError as err:
            print(f"specd: {args.token_file}: {err}", file=sys.stderr)
            return 2
        if not args.join.startswith("https://"):
            print(f"specd: --join {args.join}: a head takes Nodes on its cluster port, over TLS "
                  "(https://HEAD:CLUSTER_PORT)", file=sys.stderr)
            return 2
        token = args.join_token.secret
    args.api_keys = ()
    if args.api_key_file is not None:
        from .server.access import load_api_keys

        try:
            args.api_keys = load_api_keys(args.api_key_file)
        except (OSError, ValueError) as err:
            print(f"specd: cannot read API keys: {err}", file=sys.stderr)
            return 2
    if args.pid_file is not None:
        _write_pid_file(args.pid_file)
    try:
        _serve(args, token)
    finally:
        if args.pid_file is not None:
            _remove_pid_file(args.pid_file)
    log.info("daemon stopped")
    # Everything is drained and stopped.  Skip the interpreter's teardown: MLX
    # 0.32 aborts in its static destructors ("terminate called without an
    # active exception", exit 134) once a worker thread has built a model.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve_model(args: argparse.Namespace) -> int:
    """``specd serve``: the daemon, with the objects its command line declares."""
    from .api.manifest import ManifestError
    from .serve import declared, manifest_text

    try:
        docs, args.serve_text = declared(args)
    except (ValueError, ManifestError) as err:
        print(f"specd serve: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(manifest_text(docs, args.output), end="")
        return 0
    name, url = docs[0]["metadata"]["name"], f"http://{args.host}:{args.port}"
    print(f"specd serve: {name} ({docs[0]['spec']['source']}) on {url}/v1, state in {args.state_dir}\n"
          f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"max_tokens\": 64, "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'",
          file=sys.stderr, flush=True)
    return _daemon(args)


def _serve(args: argparse.Namespace, token: str | None) -> None:
    """Run the daemon until SIGTERM or SIGINT has drained it."""
    import ssl

    import mlx.core as mx

    from .control.agent import NodeAgent
    from .serving.cluster import Cluster
    from .control.node import Node
    from .control.plane import ControlPlane
    from .serving.registry import ModelRegistry
    from .store import Store
    from . import serve
    from .api.manifest import parse_documents
    from .control.watcher import ManifestDirectory, sync_owned
    from .core import cpu_jit
    from .core.memory import reuse_freed_memory
    from .metrics import Metrics
    from .daemon import daemon_app, run_daemon
    from .serving.tls import ClusterCA, NodeIdentity, local_names, write_private
    from .server.response_store import ResponseStore

    reuse_freed_memory()
    cpu_jit.install()  # its PATH and TMPDIR set here, on the main thread, before any engine's thread runs
    if args.mlx_memory_limit is not None:
        mx.set_memory_limit(args.mlx_memory_limit)  # engines start requests only with room under it
    _warn_without_fast_blas()
    manifests = None
    args.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(args.state_dir / "specd.db")
    if args.manifests is not None:
        manifests = ManifestDirectory(args.manifests, store)
        manifests.sync_all()
    if args.serve_text is not None:
        sync_owned(store, serve.OWNER, parse_documents(args.serve_text, serve.OWNER))
    node = Node(memory_limit=args.memory_limit, memory_reserve=args.memory_reserve, name=args.node_name)
    listeners: list[tuple[str, int, ssl.SSLContext | None]] = [(args.host, args.port, None)]
    cluster_port = args.cluster_port or args.port + 1
    cluster = None
    if args.cluster_token_file:
        ca = ClusterCA(args.state_dir / "tls")
        cluster = Cluster(store, args.cluster_token_file.read_text().strip(), ca)
        join_token = args.state_dir / "cluster-join-token"
        write_private(join_token, f"{ca.join_token(cluster.token)}\n".encode())
        listeners.append((args.host, cluster_port, ca.server_context(local_names(args.host, tuple(args.tls_san)))))
        log.info("taking Nodes over TLS", cluster_port=cluster_port, join_token_file=str(join_token))
    control = ControlPlane(store, ModelRegistry(Metrics(), load_timeout=args.load_timeout),
                           drain_grace=args.drain_grace, node=node, cluster=cluster, routing=args.routing)
    agent = None
    if args.join is not None:
        identity = NodeIdentity()
        listeners.append((args.host, cluster_port, identity.server))
        address = args.advertise or f"https://{args.host}:{cluster_port}"
        agent = NodeAgent(args.join, args.join_token, node.name, address, control.models.node_report, identity,
                          args.state_dir / "tls", control.models.reserved_by_head)
    log.info("daemon starting", host=args.host, port=args.port, state_dir=str(args.state_dir),
             objects=len(store.list()))
    app = daemon_app(control, manifests, token, drain_grace=args.drain_grace, agent=agent, api_keys=args.api_keys,
                     cors_origins=tuple(args.cors_origin), max_body_bytes=args.max_body_bytes,
                     stored_responses=ResponseStore(args.state_dir / "responses.db"),
                     drop_hosted_tools=args.drop_hosted_tools, fetch_image_urls=args.fetch_image_urls)
    run_daemon(app, listeners, shutdown_timeout=args.drain_grace)


def _warn_without_fast_blas() -> None:
    """On Linux, say at start when MLX's float32 matmul falls back to its bundled reference BLAS
    (no OpenBLAS preloaded), as ``specd doctor`` does: every model runs many times slower."""
    if sys.platform != "linux":
        return
    from .doctor import blas_fix_hint, global_sgemm_provider

    provider = global_sgemm_provider()
    if provider is None or "openblas" not in provider.lower():
        log.warning("no OpenBLAS preloaded: MLX's float32 matmul uses its reference BLAS, many times slower",
                    fix=blas_fix_hint())


def _write_pid_file(path: Path) -> None:
    """This process's pid, for scripts that stop the daemon (written whole, by rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{os.getpid()}\n")
    partial.replace(path)


def _remove_pid_file(path: Path) -> None:
    """Remove the pid file on the way out, unless another daemon has since written its own there."""
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except OSError:
        pass


def _rank(args: argparse.Namespace) -> int:
    """One rank of a tensor-parallel group; the daemon starts these (SPECD_GROUP)."""
    from .parallel import rank
    from .parallel.topology import GroupPlan

    plan = os.environ.get("SPECD_GROUP")
    if not plan:
        print("specd rank: SPECD_GROUP is not set; ranks are started by the daemon", file=sys.stderr)
        return 2
    return rank.run(GroupPlan.from_json(plan))


def _pull(args: argparse.Namespace) -> int:
    """``specd pull MODEL[@revision]``: fetch a hub checkpoint into the Hugging Face cache ahead
    of its first load, with a progress bar; an interrupted pull keeps the files it finished."""
    from huggingface_hub.utils import disable_progress_bars
    from tqdm import tqdm

    from .core.download import DownloadProgress, download
    from .core.memory import gib
    from .serve import REPO_ID_RE, split_revision

    source, revision = split_revision(args.model)
    if not REPO_ID_RE.fullmatch(source):
        print(f"specd pull: {source!r} is not a Hugging Face repo id (owner/name)", file=sys.stderr)
        return 2
    disable_progress_bars()  # one bar, ours, over every file
    bar = None

    def show(progress: DownloadProgress) -> None:
        nonlocal bar
        if bar is None:  # once the listing says how much there is
            bar = tqdm(desc=source, total=progress.total, initial=progress.done, unit="B", unit_scale=True,
                       unit_divisor=1024, mininterval=0.5)
        bar.total = progress.total
        bar.update(progress.done - bar.n)

    progress = DownloadProgress(listener=show)
    try:
        path = download(source, revision, progress)
    except Exception as err:  # the hub client's own words: offline, not found, gated, ...
        print(f"specd pull: {source}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    fetched = progress.done - progress.present
    print(f"{source}: {gib(progress.total)} in {path} ({gib(fetched)} fetched now, {gib(progress.present)} "
          "already in the cache)" if progress.total else f"{source}: in {path} (offline: from the cache)")
    return 0


def _forge(args: argparse.Namespace) -> int:
    from . import forge

    return forge.run(args)


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.run(args)


def _byte_size_arg(text: str) -> int:
    from .api.manifest import byte_size

    try:
        return byte_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``specd daemon`` and ``specd serve`` both take."""
    parser.add_argument("--state-dir", type=Path, default=Path("state"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--manifests", type=Path, default=None, help="directory of YAML manifests")
    parser.add_argument("--memory-limit", type=_byte_size_arg, default=None, metavar="BYTES",
                        help="the most memory this node's Models may request (e.g. 12Gi): lower than the host "
                             "has, to share the machine or act as a smaller Mac")
    parser.add_argument("--mlx-memory-limit", type=_byte_size_arg, default=None, metavar="BYTES",
                        help="MLX's own memory limit (mx.set_memory_limit; default MLX's, 1.5x Metal's "
                             "recommended working set): requests start only with room under it (or under the "
                             "working set, where lower), and wait or are refused with a 503 where there is none")
    parser.add_argument("--memory-reserve", type=_byte_size_arg, default=None, metavar="BYTES",
                        help="memory kept for the system, not given to Models (default: 10%% of the host's, "
                             "at least 2Gi)")
    parser.add_argument("--node-name", default=None, help="this node's name in a cluster (default: the host name)")
    parser.add_argument("--cluster-token-file", type=Path, default=None,
                        help="be a cluster head: this file holds the cluster's secret; the head writes the join "
                             "token Nodes join with (the secret and its CA's hash) to STATE/cluster-join-token "
                             "(see docs/cluster.md)")
    parser.add_argument("--routing", choices=POLICIES, default="prefix",
                        help="how a head picks a replica: the one holding the prefix unless much busier "
                             "(default), or round-robin")
    parser.add_argument("--join", default=None, metavar="URL",
                        help="join the cluster whose head takes Nodes at URL (https://HEAD:CLUSTER_PORT), as a "
                             "worker Node")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="the join token, with --join: the head writes it to STATE/cluster-join-token "
                             "(it pins the head's certificate authority)")
    parser.add_argument("--cluster-port", type=int, default=None, metavar="PORT",
                        help="a head's or worker's port for cluster traffic, TLS only (default: PORT + 1)")
    parser.add_argument("--tls-san", action="append", default=[], metavar="NAME",
                        help="a head's: another host name or address its certificate is valid for (workers "
                             "must reach it by one of them); repeatable")
    parser.add_argument("--advertise", default=None, metavar="URL",
                        help="where the head reaches this worker (default: https://HOST:CLUSTER_PORT)")
    parser.add_argument("--load-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="how long a request waits for its Model to load before a 503 with Retry-After")
    parser.add_argument("--drain-grace", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--admin-token-file", type=Path, default=None,
                        help="bearer token for the admin API (without it, loopback clients only)")
    parser.add_argument("--pid-file", type=Path, default=None,
                        help="write the daemon's pid here; removed when it exits cleanly")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="API keys the inference routes require (one per line, or a Secret with stringData)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="let browsers on ORIGIN (or *) call the inference routes; repeatable")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="largest request body accepted (larger: 413)")
    parser.add_argument("--drop-hosted-tools", action="store_true",
                        help="leave hosted tools (web_search, file_search, ...) out of /v1/responses requests "
                             "instead of answering 400 (Codex CLI sends web_search by default)")
    parser.add_argument("--fetch-image-urls", action="store_true",
                        help="fetch the http(s) image URLs requests send (each within 20 MiB and 10 s) instead of "
                             "answering 400: the daemon then makes requests to any address a client names")


class _Subcommand(argparse.ArgumentParser):
    """A subcommand whose arguments ``define`` adds only when it is the one parsed: the forge's
    come with mlx-lm and transformers, which every other command would otherwise import too."""

    def __init__(self, *args, define: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._define = define

    def parse_known_args(self, args=None, namespace=None):
        if self._define is not None:
            define, self._define = self._define, None
            define(self)
        return super().parse_known_args(args, namespace)


def _forge_arguments(parser: argparse.ArgumentParser) -> None:
    from . import forge

    forge.add_arguments(parser)


def _trainer(module: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """A forge trainer's (add its arguments, run it), imported only when its command is used."""
    def load():
        return importlib.import_module(f"specd.forge.{module}")
    return (lambda parser: load().add_arguments(parser)), (lambda args: load().run(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Subcommand)

    daemon = sub.add_parser("daemon", help="run the serving daemon")
    add_daemon_arguments(daemon)
    daemon.set_defaults(func=_daemon, serve_text=None)

    from . import serve

    serve_cmd = sub.add_parser("serve", help="serve one model in one command (a hub repo id or a directory)",
                               description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_arguments(serve_cmd)
    add_daemon_arguments(serve_cmd)
    serve_cmd.set_defaults(func=_serve_model, state_dir=serve.default_state_dir())

    sub.add_parser("rank", help="one rank of a tensor-parallel group (started by the daemon)").set_defaults(
        func=_rank)

    from . import client

    client.add_commands(sub)

    pull = sub.add_parser("pull", help="download a hub model into the Hugging Face cache, with progress")
    pull.add_argument("model", metavar="MODEL[@REVISION]", help="a Hugging Face repo id, optionally @branch/tag/commit")
    pull.set_defaults(func=_pull)

    sub.add_parser("forge", help="build a deterministic target/draft model pair",
                   define=_forge_arguments).set_defaults(func=_forge)
    for command, module, what in (("train-eagle", "eagle", "train an EAGLE draft head for a local target"),
                                  ("train-mtp", "mtp", "train an MTP head into a local target's checkpoint"),
                                  ("train-dflash", "dflash", "train a DFlash block drafter for a local target")):
        define, run = _trainer(module)
        sub.add_parser(command, help=what, define=define).set_defaults(func=run)

    from . import service

    service.add_commands(sub)

    doctor = sub.add_parser("doctor", help="check this host: Python, MLX, BLAS, memory, state dir, RDMA")
    doctor.add_argument("--manifests", type=Path, default=None,
                        help="directory of YAML manifests whose models must fit in memory")
    doctor.add_argument("--state-dir", type=Path, default=Path("state"))
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader went away (``specd describe ... | head``): stop quietly, as coreutils do,
        # pointing stdout at /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command a pipe's reader cut off


if __name__ == "__main__":
    sys.exit(main())
