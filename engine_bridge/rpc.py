"""llama.cpp RPC servers (``rpc-server``, started by ``flux rpc-server``): who they are and what the link costs.

Flux speaks the server's own protocol (ggml-rpc.cpp, protocol 7.x) over a plain socket, so asking costs no
library load and cannot crash the caller: a HELLO, Flux's build-id command (patch 0005: the id ``flux
rpc-server`` started the server with), the device count and each device's memory. The link is timed with
the messages a step sends: round trips of an empty command, and tensors written to and read from a buffer
allocated on the server (then freed) at the sizes a decode step (a hidden state) and a prefill batch move.

A server serves one client at a time: while a worker holds it, a probe's HELLO waits. :func:`reachable` (a TCP
connect) is what ``/health`` asks of a server that is in use.
"""

from __future__ import annotations

import re
import socket
import statistics
import struct
import time
from collections.abc import Sequence

from artifacts.errors import FluxError
from artifacts.records.hardware import RpcDevice, RpcLink, RpcServer

CMD_ALLOC_BUFFER, CMD_BUFFER_GET_BASE, CMD_FREE_BUFFER = 0, 3, 4
CMD_SET_TENSOR, CMD_GET_TENSOR, CMD_GET_DEVICE_MEMORY = 6, 8, 11
CMD_HELLO, CMD_DEVICE_COUNT, CMD_FLUX_BUILD_ID = 14, 15, 0xF1
PROTO_MAJOR = 7
CONN_CAPS = 24  # bytes of transport capabilities in HELLO; all zero: plain TCP
# rpc_tensor (packed): id u64, type u32, buffer u64, ne u32[4], nb u32[4], op u32, op_params i32[16], flags i32,
# src u64[10], view_src u64, view_offs u64, data u64, name char[64], use_count i32
_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
GGML_TYPE_F32 = 0
ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")
SMALL, LARGE = 16 * 1024, 8 * 1024 * 1024  # a decode step's hidden state (order of); a prefill batch's


class RpcError(FluxError):
    """An RPC server that does not answer, answers another protocol or build, or a malformed endpoint."""


def parse_endpoints(values: Sequence[str]) -> tuple[str, ...]:
    """``host:port`` endpoints, checked: the format, the port range, no endpoint twice.

    Raises:
        RpcError: the first bad one, named with what to pass instead.
    """
    seen: list[str] = []
    for raw in values:
        ep = raw.strip()
        m = ENDPOINT.match(ep)
        if not m or not 0 < int(m["port"]) < 65536:
            raise RpcError(f"--rpc {raw!r}: expected host:port (e.g. 127.0.0.1:50052), separated by commas")
        if ep in seen:
            raise RpcError(f"--rpc: {ep} is given twice; name each server once")
        seen.append(ep)
    return tuple(seen)


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def reachable(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``endpoint`` (a busy server still does)."""
    try:
        with socket.create_connection(_split(endpoint), timeout=timeout_s):
            return True
    except OSError:
        return False


class RpcConnection:
    """One client connection to an RPC server, after the HELLO handshake."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        try:
            self.sock = socket.create_connection(_split(endpoint), timeout=timeout_s)
        except OSError as exc:
            raise RpcError(f"RPC server {endpoint} does not answer ({exc.strerror or exc}): start it there with "
                           f"`flux rpc-server --port {_split(endpoint)[1]}`, or check --rpc") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            rsp = self.call(CMD_HELLO, bytes(CONN_CAPS))
        except (OSError, RpcError):
            self.close()
            raise RpcError(f"RPC server {endpoint} accepted the connection but did not answer the handshake within "
                           f"{timeout_s:g} s: it is serving another client, or it is not a llama.cpp rpc-server") from None
        self.version = f"{rsp[0]}.{rsp[1]}.{rsp[2]}"
        if rsp[0] != PROTO_MAJOR:
            self.close()
            raise RpcError(f"RPC server {endpoint} speaks protocol {self.version}, this build {PROTO_MAJOR}.x: run "
                           "the same Flux build there (`flux rpc-server`)")

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise RpcError(f"RPC server {self.endpoint} closed the connection")
            buf += chunk
        return bytes(buf)

    def send(self, cmd: int, payload: bytes = b"") -> None:
        """A command without a reply."""
        self.sock.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)

    def call(self, cmd: int, payload: bytes = b"") -> bytes:
        """A command and its reply's payload."""
        self.send(cmd, payload)
        (size,) = struct.unpack("<Q", self._recv(8))
        return self._recv(size)

    def build_id(self) -> str:
        """The Flux build id the server was started with ('' for a server not started by ``flux rpc-server``)."""
        return self.call(CMD_FLUX_BUILD_ID).decode(errors="replace")

    def devices(self) -> list[RpcDevice]:
        """Each device's index and memory (free, total)."""
        (n,) = struct.unpack("<I", self.call(CMD_DEVICE_COUNT))
        out = []
        for i in range(n):
            free, total = struct.unpack("<QQ", self.call(CMD_GET_DEVICE_MEMORY, struct.pack("<I", i)))
            out.append(RpcDevice(index=i, memory_free=free, memory_total=total))
        return out

    def _tensor(self, buffer: int, base: int, nbytes: int) -> bytes:
        n = nbytes // 4
        return _TENSOR.pack(1, GGML_TYPE_F32, buffer, n, 1, 1, 1, 4, 4 * n, 4 * n, 4 * n, 0, *([0] * 16), 0,
                            *([0] * 10), 0, 0, base, b"flux-link", 0)

    def link(self, device: int = 0, rounds: int = 5) -> RpcLink:
        """Round-trip latency and bandwidth each way, measured with the sizes a step moves."""
        rtt = []
        for _ in range(max(10, rounds * 4)):
            t0 = time.perf_counter()
            self.call(CMD_DEVICE_COUNT)
            rtt.append(time.perf_counter() - t0)
        remote, _ = struct.unpack("<QQ", self.call(CMD_ALLOC_BUFFER, struct.pack("<IQ", device, LARGE)))
        if not remote:
            raise RpcError(f"RPC server {self.endpoint} could not allocate {LARGE >> 20} MiB on its device {device}")
        try:
            (base,) = struct.unpack("<Q", self.call(CMD_BUFFER_GET_BASE, struct.pack("<Q", remote)))
            up, down = {}, {}
            for size in (SMALL, LARGE):
                data, tensor = bytes(size), self._tensor(remote, base, size)
                ups, downs = [], []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    self.send(CMD_SET_TENSOR, tensor + b"\0" + struct.pack("<Q", 0) + data)
                    self.call(CMD_DEVICE_COUNT)  # the write has no reply: a round trip after it bounds it
                    ups.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = self.call(CMD_GET_TENSOR, tensor + struct.pack("<QQ", 0, size))
                    downs.append(time.perf_counter() - t0)
                    if len(got) != size:
                        raise RpcError(f"RPC server {self.endpoint} returned {len(got)} of {size} bytes")
                up[size], down[size] = statistics.median(ups), statistics.median(downs)
        finally:
            self.send(CMD_FREE_BUFFER, struct.pack("<Q", remote))
        rtt_s = statistics.median(rtt)
        return RpcLink(rtt_ms=rtt_s * 1e3, up_small_ms=up[SMALL] * 1e3, down_small_ms=down[SMALL] * 1e3,
                       up_gbs=LARGE / max(up[LARGE] - rtt_s, 1e-6) / 1e9,
                       down_gbs=LARGE / max(down[LARGE] - rtt_s, 1e-6) / 1e9)

    def close(self) -> None:
        """Close the connection (the server then takes its next client)."""
        self.sock.close()

    def __enter__(self) -> RpcConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def identify(endpoint: str, build_id: str, timeout_s: float = 5.0) -> RpcServer:
    """The server's protocol, build and devices, refused when its build is not ``build_id``.

    Raises:
        RpcError: it does not answer, speaks another protocol, or runs another build (both ids named).
    """
    with RpcConnection(endpoint, timeout_s) as c:
        theirs = c.build_id()
        if theirs != build_id:
            raise RpcError(f"RPC server {endpoint} runs backend build {theirs or '(not started by flux rpc-server)'}, "
                           f"this machine {build_id}: run `flux rpc-server` from the same Flux build there")
        return RpcServer(endpoint=endpoint, build_id=theirs, protocol=c.version, devices=c.devices())


def measure(server: RpcServer, timeout_s: float = 30.0) -> RpcServer:
    """``server`` with its link measured (to its first device) and its devices' memory read again."""
    with RpcConnection(server.endpoint, timeout_s) as c:
        return server.model_copy(update={"devices": c.devices(), "link": c.link()})
