"""Frames between the daemon and a group's rank 0: a 4-byte length, then a pickle.

Both ends are the same specd version inside one trust boundary (the cluster
the Topology names), and rank 0 proves itself with the group's token in its
first frame, so pickle carries the engine's own dataclasses as they are.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

_LENGTH = struct.Struct(">I")


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> Any:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


def recv_message(sock: socket.socket) -> Any:
    """Blocking read of one frame (rank 0's side); EOFError when the daemon is gone."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    return pickle.loads(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
