"""Optional mutual TLS between machines, over real loopback sockets, with a cluster CA made by
the `openssl` command in the test: frames are encrypted (no plaintext on the wire), a peer with
no certificate or one from another CA is refused, and the token's HMAC still applies on top."""

import asyncio
import shutil
import subprocess

import pytest

from phalanx.core.errors import TransportError
from phalanx.core.messages import Heartbeat
from phalanx.transport.tcp import TcpTransport, TlsFiles

TOKEN = b"s" * 32
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _ca(d, name):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                    "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem")], check=True, capture_output=True)


def _node(d, ca, name):
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                    "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr")], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.pem"),
                    "-CAkey", str(d / f"{ca}.key"), "-CAcreateserial", "-days", "2", "-out", str(d / f"{name}.pem")],
                   check=True, capture_output=True)
    return TlsFiles(str(d / f"{name}.pem"), str(d / f"{name}.key"), str(d / f"{ca}.pem"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "cluster")
    _ca(d, "other")
    return {"coord": _node(d, "cluster", "coord"), "worker": _node(d, "cluster", "worker"),
            "stranger": _node(d, "other", "stranger")}


async def _serve(tls, seen):
    server = TcpTransport(TOKEN, tls=tls)

    async def on_conn(conn):
        try:
            while True:
                m, _ = await conn.recv()
                seen.append(m)
                await conn.send(m)
        except TransportError:
            pass

    return await server.listen("127.0.0.1:0", on_conn)


def test_mutual_tls_round_trip_is_encrypted_on_the_wire(pki):
    async def main():
        seen = []
        listener = await _serve(pki["coord"], seen)
        host, port = listener.address.rsplit(":", 1)
        # a tap in the middle: forward bytes and keep a copy of what crosses the wire
        wire = bytearray()

        async def pipe(r, w):
            while data := await r.read(1 << 16):
                wire.extend(data)
                w.write(data)
                await w.drain()
            w.close()

        async def tap(cr, cw):
            sr, sw = await asyncio.open_connection(host, int(port))
            await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

        proxy = await asyncio.start_server(tap, "127.0.0.1", 0)
        paddr = "127.0.0.1:%d" % proxy.sockets[0].getsockname()[1]
        conn = await TcpTransport(TOKEN, name="secret-worker-name", tls=pki["worker"]).connect(paddr, 5)
        await conn.send(Heartbeat(seq=424242, step=777), [b"PLAINTEXT-TENSOR-BYTES" * 10])
        m, _ = await conn.recv()
        conn.close()
        proxy.close()
        return m, bytes(wire)

    m, wire = asyncio.run(asyncio.wait_for(main(), 20))
    assert m == Heartbeat(seq=424242, step=777)
    assert b"PLAINTEXT-TENSOR-BYTES" not in wire and b"secret-worker-name" not in wire and len(wire) > 500


@pytest.mark.parametrize("client", ["none", "stranger"])
def test_a_peer_without_a_certificate_of_the_cluster_ca_is_refused(pki, client):
    async def main():
        seen = []
        listener = await _serve(pki["coord"], seen)
        tls = None if client == "none" else pki[client]
        with pytest.raises(TransportError):
            conn = await TcpTransport(TOKEN, tls=tls, handshake_timeout_s=3).connect(listener.address, 3)
            await conn.send(Heartbeat(seq=1, step=1))
            await conn.recv()
        good = await TcpTransport(TOKEN, tls=pki["worker"]).connect(listener.address, 5)
        await good.send(Heartbeat(seq=2, step=2))
        return (await good.recv())[0], seen

    m, seen = asyncio.run(asyncio.wait_for(main(), 20))
    assert m == Heartbeat(seq=2, step=2) and seen == [Heartbeat(seq=2, step=2)]


def test_tls_settings_from_the_environment_must_be_complete():
    assert TlsFiles.from_env({}) is None
    with pytest.raises(TransportError, match="PHALANX_TLS_KEY"):
        TlsFiles.from_env({"PHALANX_TLS_CERT": "a.pem", "PHALANX_TLS_CA": "ca.pem"})


def test_the_token_still_authenticates_inside_tls(pki):
    async def main():
        listener = await _serve(pki["coord"], [])
        with pytest.raises(TransportError):
            await TcpTransport(b"w" * 32, tls=pki["worker"]).connect(listener.address, 3)
    asyncio.run(asyncio.wait_for(main(), 20))  # the wrong token is refused at the HMAC handshake, as without TLS
