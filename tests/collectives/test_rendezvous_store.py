"""The rendezvous store of a local run listens on loopback only (torch's own TCPStore server
listens on every interface, whatever host it is given)."""

import torch.distributed as dist

from phalanx.collectives.process_group import RendezvousStore


def _listening_addresses(port):
    """Local addresses (hex, as /proc/net/tcp{,6} lists them) listening on ``port``."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                out.append(addr)
    return out


def test_the_store_listens_on_loopback_only_and_works():
    rs = RendezvousStore("127.0.0.1")
    assert _listening_addresses(rs.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
    client = dist.TCPStore("127.0.0.1", rs.port, is_master=False)
    client.set("k", "v")
    assert rs.store.get("k") == b"v"


def test_torch_alone_would_listen_everywhere():
    # why RendezvousStore exists: if this ever starts failing, torch fixed it
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert set(_listening_addresses(s.port)) & {"00000000", "00000000000000000000000000000000"}
