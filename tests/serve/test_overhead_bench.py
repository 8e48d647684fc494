"""The router-overhead benchmark's interleaved estimator (session 16): one Poisson stream alternating between the
replica's own port (signed, as a user of the replica would have to) and the router (unsigned), in blocks."""

from __future__ import annotations

import asyncio

from phalanx.bench.serving_speed import _interleaved_lean_s


def test_the_interleaved_stream_alternates_blocks_between_a_signed_direct_call_and_the_router():
    seen: dict[str, list[tuple[float, bool]]] = {"direct": [], "router": []}

    def handler_for(side: str):
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(10_000):  # bounded: one keep-alive connection's requests
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.lower().split(b"\r\n")
                n = int(next(ln for ln in lines if ln.startswith(b"content-length")).split(b":")[1])
                await reader.readexactly(n)
                seen[side].append((asyncio.get_running_loop().time(), any(ln.startswith(b"x-phalanx-auth:") for ln in lines)))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        return handler

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        servers = {side: await asyncio.start_server(handler_for(side), "127.0.0.1", 0) for side in seen}
        port = {side: s.sockets[0].getsockname()[1] for side, s in servers.items()}
        start = loop.time()
        out = await _interleaved_lean_s(f"http://127.0.0.1:{port['direct']}", b"k" * 32,
                                        f"http://127.0.0.1:{port['router']}", rate=200.0, duration_s=1.6, block_s=0.2)
        for s in servers.values():
            s.close()
        out["start"] = start
        return out

    out = asyncio.run(run())
    lat = out["latencies_s"]
    assert out["failed"] == {"direct": 0, "router": 0}
    assert len(lat["direct"]) == len(seen["direct"]) > 60 and len(lat["router"]) == len(seen["router"]) > 60
    assert all(signed for _, signed in seen["direct"])  # direct calls are signed with the cluster token ...
    assert not any(signed for _, signed in seen["router"])  # ... calls to the router are not (it signs them)
    # blocks of 0.2 s in the order D R R D D R R D: most of each side's requests reach its server in its own
    # blocks (a request is labelled by its scheduled arrival; a stalled loop sends some late, hence "most")
    for side, blocks in (("direct", {0, 3, 4, 7}), ("router", {1, 2, 5, 6})):
        got = [min(7, int((t - out["start"]) / 0.2)) for t, _ in seen[side]]
        assert sum(b in blocks for b in got) >= 0.7 * len(got), (side, got)
