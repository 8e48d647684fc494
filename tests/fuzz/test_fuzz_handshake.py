"""The handshake state machine over real loopback sockets: whatever bytes arrive first (random,
a truncated or mutated ClientHello, a huge length), the server refuses that connection cleanly
and keeps serving authenticated peers."""

import asyncio
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core import auth
from phalanx.core.codec import LEN, encode_body
from phalanx.core.errors import TransportError
from phalanx.core.messages import PROTOCOL_VERSION, ClientHello, Heartbeat
from phalanx.transport.tcp import TcpTransport

TOKEN = b"f" * 32


def _hello() -> bytes:
    body = b"".join(bytes(p) for p in encode_body(ClientHello(protocol_version=PROTOCOL_VERSION,
                                                              nonce=os.urandom(16), client="fz")))
    return LEN.pack(len(body)) + auth.handshake_mac(TOKEN, body) + body


FIRST_BYTES = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda cut: _hello()[:cut], st.integers(0, 120)),
    st.builds(lambda pos, val: (lambda h: h[:pos] + bytes([val]) + h[pos + 1:])(_hello()),
              st.integers(0, 100), st.integers(0, 255)),
    st.builds(lambda n: LEN.pack(n) + b"\x00" * 40, st.integers(0, 2**32 - 1)),
)


@settings(max_examples=int(os.environ.get("PHALANX_FUZZ_EXAMPLES", "40")) // 3 + 10)
@given(FIRST_BYTES)
def test_any_first_bytes_are_refused_or_authenticated_and_service_goes_on(first):
    async def main():
        server = TcpTransport(TOKEN, handshake_timeout_s=0.5)

        async def echo(conn):
            try:
                while True:
                    m, _ = await conn.recv()
                    await conn.send(m)
            except TransportError:
                pass

        listener = await server.listen("127.0.0.1:0", echo)
        host, port = listener.address.rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(port))
        w.write(first)
        await w.drain()
        w.write_eof()
        try:
            await asyncio.wait_for(r.read(), 3)  # the server answers or closes; it never hangs on us
        except (ConnectionError, asyncio.TimeoutError):
            pass
        w.close()
        conn = await TcpTransport(TOKEN).connect(listener.address, 3)
        await conn.send(Heartbeat(seq=1, step=1))
        m, _ = await conn.recv()
        conn.close()
        listener.close()
        return m

    assert asyncio.run(asyncio.wait_for(main(), 15)) == Heartbeat(seq=1, step=1)
