"""A link between two Macs, on loopback: a TCP forwarder that keeps every byte it carries and may
delay it as a lossy, jittery network does.

TCP hides a lost packet from the application as a stall (the retransmission) and jitter as
uneven delays, in order; that is what a daemon on either side sees, and what this link gives each
chunk it forwards, in each direction. (The kernels here have no ``tc netem``.)"""

from __future__ import annotations

import asyncio
import random
import threading

from conftest import free_port


class LinkProxy:
    """Forwards a loopback port to ``target_port``. Each chunk, each way, waits ``delay`` seconds
    plus up to ``jitter`` more, and with probability ``loss`` a further ``stall`` (a retransmission)."""

    def __init__(self, target_port: int, delay: float = 0.0, jitter: float = 0.0, loss: float = 0.0,
                 stall: float = 0.0, seed: int = 0):
        self.port, self.target_port, self.seen = free_port(), target_port, bytearray()
        self.delay, self.jitter, self.loss, self.stall = delay, jitter, loss, stall
        self.stalls = 0
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _wait(self) -> float:
        seconds = self.delay + self._random.uniform(0, self.jitter)
        if self._random.random() < self.loss:
            self.stalls += 1
            seconds += self.stall
        return seconds

    def _run(self, started: threading.Event) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    self.seen += data
                    if wait := self._wait():
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def forward(client_reader, client_writer) -> None:
            try:
                server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                client_writer.close()
                return
            await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

        async def main() -> None:
            await asyncio.start_server(forward, "127.0.0.1", self.port)
            started.set()
            await asyncio.Event().wait()
        self._loop.run_until_complete(main())
