#!/usr/bin/env python3
"""A link with added latency between this host and a second one, for ``cluster.py --links``.

This kernel has no ``sch_netem`` (``tc``'s delay) and there is no iptables or
nft to redirect traffic into a delaying proxy, so the latency is added by a
relay that the ranks connect to by address alone. The second host is a network
namespace ``B`` that shares no link with this one: each side reaches the other's
address in a namespace of its own that owns that address (``to-B`` here, ``to-A``
in B), where the relay listens; the relay opens its onward connection inside the
peer's namespace (``setns``) and holds every chunk back by the one-way delay
before passing it on, in order, both ways. Each side addresses the other as
usual, so the ranks are unchanged: rank 0 here, rank 1 in B, over a ring.

    here (A)  10.77.t.1 --veth-- to-B: 10.77.t.2  [relay listens] ==delay==> B: 10.77.t.2 (rank 1)
    B         10.77.t.2 --veth-- to-A: 10.77.t.1  [relay listens] ==delay==> A: 10.77.t.1 (rank 0)

The relay itself (Python threads, ``TCP_NODELAY`` both sides) adds its own
latency; ``cluster.py`` measures it as the 0 ms setting.

    python ops/bench/delayed_link.py relay NS:ADDR:PORT=NS:ADDR:PORT ...   (stdin: one-way delay in ms, a line each)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_delay = 0.0  # seconds each chunk is held back
_HOME = f"/proc/{os.getpid()}/ns/net"  # "-": the main thread's namespace, which it never leaves


def _namespace_fd(ns: str) -> int:
    return os.open(_HOME if ns == "-" else f"/var/run/netns/{ns}", os.O_RDONLY)


def _socket_in(ns: str) -> socket.socket:
    """A TCP socket that lives in network namespace ``ns`` ("-": the host's). ``setns`` moves only
    the calling thread, and a socket stays in the namespace it was made in."""
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = _namespace_fd(ns)
    try:
        if _libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _libc.setns(here, CLONE_NEWNET)
    finally:
        os.close(here)
        os.close(there)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst``, each chunk sent ``_delay`` after it arrived."""
    held: queue.Queue = queue.Queue()

    def send() -> None:
        while True:
            due, chunk = held.get()
            if chunk is None:
                break
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            try:
                dst.sendall(chunk)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    while True:
        try:
            chunk = src.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            break
        held.put((time.perf_counter() + _delay, chunk))
    held.put((0.0, None))
    sender.join()


def _serve(listen: tuple[str, str, int], onward: tuple[str, str, int]) -> None:
    server = _socket_in(listen[0])
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((listen[1], listen[2]))
    server.listen(16)
    while True:
        near, _ = server.accept()
        near.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_connect, args=(near, onward), daemon=True).start()


def _connect(near: socket.socket, onward: tuple[str, str, int]) -> None:
    """Join ``near`` to the listener at ``onward``, retrying while it is not up yet (a rank still loading)."""
    deadline = time.monotonic() + 600
    while True:
        far = _socket_in(onward[0])
        try:
            far.connect((onward[1], onward[2]))
            break
        except OSError:
            far.close()
            if time.monotonic() > deadline:
                near.close()
                return
            time.sleep(0.1)
    for src, dst in ((near, far), (far, near)):
        threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _endpoint(text: str) -> tuple[str, str, int]:
    ns, address, port = text.split(":")
    return ns, address, int(port)


def relay(routes: list[str]) -> None:
    global _delay
    for route in routes:
        listen, onward = route.split("=")
        threading.Thread(target=_serve, args=(_endpoint(listen), _endpoint(onward)), daemon=True).start()
    print("listening", flush=True)
    for line in sys.stdin:
        _delay = float(line) / 1000
        print(f"delay {line.strip()} ms", flush=True)


def netns_rsh(workdir: Path) -> Path:
    """An ``SPECD_RSH`` for the ssh launcher that runs a command in the network namespace named as its host."""
    workdir.mkdir(parents=True, exist_ok=True)
    rsh = workdir / "netns-rsh"
    rsh.write_text('#!/bin/sh\nhost="$1"; shift\nexec ip netns exec "$host" sh -c "$*"\n')
    rsh.chmod(0o755)
    return rsh


class DelayedLink:
    """The namespaces and the relay; ``set_delay(ms)`` changes the one-way latency under running connections."""

    def __init__(self, proc: subprocess.Popen, ns: str, subnet: str, rsh: Path):
        self.proc, self.ns, self.subnet, self.rsh = proc, ns, subnet, rsh

    def set_delay(self, ms: float) -> None:
        self.proc.stdin.write(f"{ms}\n")
        self.proc.stdin.flush()
        self.proc.stdout.readline()


@contextlib.contextmanager
def delayed_link(workdir: Path, port_pairs: list[tuple[int, int]]):
    """Host B (a namespace) reachable from here and back only through the relay, for rank 0
    listening here on ``subnet.1:p0`` and rank 1 in B on ``subnet.2:p1``, per (p0, p1)."""
    tag = os.getpid() % 250
    b, to_b, to_a, subnet = f"specd-lat-{tag}", f"specd-lat-{tag}-to-b", f"specd-lat-{tag}-to-a", f"10.77.{tag}"
    here, near_b, b_end, near_a = (f"sla{tag}{x}" for x in "abcd")
    setup = [f"ip netns add {b}", f"ip netns add {to_b}", f"ip netns add {to_a}",
             f"ip link add {here} type veth peer name {near_b}", f"ip link set {near_b} netns {to_b}",
             f"ip addr add {subnet}.1/24 dev {here}", f"ip link set {here} up",
             f"ip netns exec {to_b} ip addr add {subnet}.2/24 dev {near_b}",
             f"ip netns exec {to_b} ip link set {near_b} up",
             f"ip link add {b_end} type veth peer name {near_a}", f"ip link set {b_end} netns {b}",
             f"ip link set {near_a} netns {to_a}",
             f"ip netns exec {b} ip addr add {subnet}.2/24 dev {b_end}", f"ip netns exec {b} ip link set {b_end} up",
             f"ip netns exec {to_a} ip addr add {subnet}.1/24 dev {near_a}",
             f"ip netns exec {to_a} ip link set {near_a} up",
             *(f"ip netns exec {ns} ip link set lo up" for ns in (b, to_b, to_a))]
    rsh = netns_rsh(workdir)
    proc = None
    try:
        for cmd in setup:
            subprocess.run(cmd.split(), check=True, capture_output=True)
        routes = [r for p0, p1 in port_pairs for r in (f"{to_b}:{subnet}.2:{p1}={b}:{subnet}.2:{p1}",
                                                       f"{to_a}:{subnet}.1:{p0}=-:{subnet}.1:{p0}")]
        proc = subprocess.Popen([sys.executable, __file__, "relay", *routes], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        yield DelayedLink(proc, b, subnet, rsh)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        for ns in (b, to_b, to_a):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["relay"]:
        sys.exit(__doc__)
    relay(sys.argv[2:])
