"""A doorbell from rank 0 to every other rank: one byte over TCP before each
lock-step round, so that a rank waiting for rank 0 waits in the kernel.

MLX's ring backend busy-waits inside a collective (measured on 0.32: a rank
that waited 3 s in ``all_sum`` for its peer burnt 2.96 s of CPU). Without a
doorbell an idle sharded server would keep a core busy on every rank but 0,
for as long as it runs. With it a rank blocks in ``recv`` until rank 0 is
about to start a round, and the round's collectives only wait for the other
side's few microseconds of lag. The bell also tells a rank at once that rank
0 is gone (the connection closes), and rank 0 that a rank is (the next ring
fails).

It is set up once, after the model is loaded: rank 0 listens on an
ephemeral port and tells the other ranks (through a collective) where, with a
secret each must send back; ranks that can reach it are rung, any that cannot
(an address rank 0 cannot be reached on) still work, spinning. Blocking calls
throughout, on the engine thread of each rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field

from .world import Link

log = logging.getLogger("mlxtrio.engine")

CONNECT_TIMEOUT = 2.0  # seconds per address a rank tries
ACCEPT_TIMEOUT = 10.0  # seconds rank 0 waits for the ranks that connected
_HELLO = struct.Struct("!16sI")  # the secret, the rank


@dataclass
class Doorbell:
    """Rank 0's connections to the ranks it rings, or a rank's to rank 0."""

    sockets: dict[int, socket.socket] = field(default_factory=dict)

    def ring(self) -> None:
        """Rank 0: wake every rank for a round. Raises ConnectionError when a
        rank's connection is gone (its process ended)."""
        for rank, sock in self.sockets.items():
            try:
                sock.sendall(b"\x01")
            except OSError as exc:
                raise ConnectionError(
                    f"rank {rank} is gone: its connection was lost ({exc})"
                ) from exc

    def wait(self) -> None:
        """Another rank: block until rank 0 rings (at once if it has not
        one). Raises ConnectionError when rank 0 is gone."""
        sock = self.sockets.get(0)
        if sock is not None and not sock.recv(1):
            raise ConnectionError("rank 0 closed the doorbell: it has stopped")

    def close(self) -> None:
        for sock in self.sockets.values():
            with contextlib.suppress(OSError):
                sock.close()
        self.sockets.clear()


def open_doorbell(link: Link) -> Doorbell:
    """Connect rank 0 with every rank that can reach it (every rank calls this)."""
    world = link.world
    listener = None
    offer = None
    if world.leader:
        listener = socket.create_server(("0.0.0.0", 0), backlog=world.size)
        offer = {
            "hosts": _leader_addresses(),
            "port": listener.getsockname()[1],
            "secret": secrets.token_hex(16),
        }
    offer = link.share_json(offer)
    mine = None if world.leader else _connect(offer, world.rank)
    connected = {rank for rank, (ok,) in enumerate(link.gather_ints([mine is not None])) if ok}
    accepted: dict[int, socket.socket] = {}
    if listener is not None:
        with listener:
            accepted = _accept(listener, bytes.fromhex(offer["secret"]), connected)
    rung = set(link.share_json(sorted(accepted)))
    if world.leader:
        missing = sorted(set(range(1, world.size)) - rung)
        if missing:
            log.warning(
                "rank(s) %s cannot reach rank 0's doorbell (%s:%d): they will keep a "
                "core busy while they wait for rank 0",
                ", ".join(map(str, missing)),
                "/".join(offer["hosts"]),
                offer["port"],
            )
        return Doorbell(accepted)
    if mine is not None and world.rank in rung:
        return Doorbell({0: mine})
    if mine is not None:
        mine.close()
    return Doorbell()


def _leader_addresses() -> list[str]:
    """Where the other ranks may reach rank 0: its addresses in the ring
    backend's hostfile (the ranks talk over them already), its host name,
    and loopback (every rank on one machine)."""
    found: list[str] = []
    try:
        with open(os.environ.get("MLX_HOSTFILE", ""), encoding="utf-8") as hostfile:
            ring = json.load(hostfile)
        found += [entry.rsplit(":", 1)[0].strip("[]") for entry in ring[0]]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        pass
    found += [socket.gethostname(), "127.0.0.1"]
    return list(dict.fromkeys(found))


def _connect(offer: dict[str, object], rank: int) -> socket.socket | None:
    secret = bytes.fromhex(str(offer["secret"]))
    for host in offer["hosts"]:  # type: ignore[attr-defined]
        try:
            sock = socket.create_connection((host, int(offer["port"])), CONNECT_TIMEOUT)  # type: ignore[call-overload]
        except OSError:
            continue
        try:
            sock.settimeout(None)
            sock.sendall(_HELLO.pack(secret, rank))
            return sock
        except OSError:
            sock.close()
    return None


def _accept(listener: socket.socket, secret: bytes, expected: set[int]) -> dict[int, socket.socket]:
    """The connections of the ranks in ``expected`` that sent the secret (others
    are closed: anyone may knock while the port is open)."""
    accepted: dict[int, socket.socket] = {}
    deadline = time.monotonic() + ACCEPT_TIMEOUT
    while not expected <= accepted.keys():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except OSError:  # the deadline: go on with those that came
            break
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            hello = _recv_exactly(sock, _HELLO.size)
            given, rank = _HELLO.unpack(hello)
        except (OSError, struct.error):
            sock.close()
            continue
        if not secrets.compare_digest(given, secret) or rank not in expected:
            sock.close()
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        accepted[rank] = sock
    return accepted


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("closed during the hello")
        data += chunk
    return data
