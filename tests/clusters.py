"""A cluster under test: a head and the workers that join it with its join token, as
``docs/cluster.md`` starts them, and what the head says of its Nodes."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path

from conftest import start_daemon
from daemons import wait_for

BUDGETS = {"kvCache": "{maxBytes: 16Mi}", "prefixCache": "{maxBytes: 16Mi}"}  # small caches: room on any Node


def token_file(tmp: Path, token: str = "s3cret-cluster-token") -> Path:
    path = tmp / f"token-{token}"
    path.write_text(token + "\n")
    return path


def head(tmp: Path) -> object:
    """A head with no room of its own (1 MiB): every replica goes to a worker."""
    return start_daemon(tmp / "head", {}, True, "--cluster-token-file", str(token_file(tmp)),
                        "--memory-limit", "1Mi", "--node-name", "head")


def join_token(h) -> Path:
    """The join token the head wrote: its secret and the hash of its CA."""
    return h.state / "cluster-join-token"


def worker(tmp: Path, name: str, h, token: Path | None = None, *extra: str, **kwargs) -> object:
    """A worker joining ``h`` on its cluster port with its join token (or ``token``)."""
    return start_daemon(tmp / name, {}, True, "--join", h.cluster_url, "--token-file", str(token or join_token(h)),
                        "--node-name", name, *(extra or ("--memory-limit", "2Gi")), **kwargs)


def nodes(daemon) -> dict[str, dict]:
    items = json.loads(daemon.get("/apis/specd.dev/v1alpha1/nodes")[1])["items"]
    return {n["metadata"]["name"]: n for n in items}


def node_ready(daemon, name: str) -> bool:
    node = nodes(daemon).get(name)
    return node is not None and node["status"]["conditions"][0]["status"] == "True"


@contextlib.contextmanager
def joined(tmp: Path, names: tuple[str, ...] = ("w1", "w2")) -> Iterator[tuple[object, dict[str, object]]]:
    """A head and the workers ``names``, each Ready on the head; all killed at the end."""
    h = head(tmp)
    workers = {n: worker(tmp, n, h) for n in names}
    try:
        wait_for(lambda: all(node_ready(h, n) for n in names), 30, "workers joined")
        yield h, workers
    finally:
        for d in [h, *workers.values()]:
            d.stop(signal.SIGKILL)
