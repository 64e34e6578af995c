"""Peer failures with real processes: a killed or hung sender never hangs the receiver.

SIGKILL closes the dead process's sockets, so the receiver sees PeerLost at once; SIGSTOP
leaves them open and silent, so the receiver sees TransferTimeout at the deadline. Both are
TransferError, and either way the receiver keeps working with other and new peers.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtransfer import GroupRegistry, KVTransfer, PeerLost, TransferError, TransferTimeout
from tests.kvtransfer.peer import SenderProcess, make_cache, make_descriptor

DEADLINE = 3.0
BIG = 8192  # blocks: 16 MiB over 4 layers, far more than loopback socket buffers hold


@pytest.fixture
def registry():
    reg = GroupRegistry("cpu", timeout=DEADLINE)
    yield reg
    reg.close()


@pytest.fixture
def procs():
    started: list[SenderProcess] = []

    def start(**kwargs) -> SenderProcess:
        proc = SenderProcess(timeout=DEADLINE, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.close()


def roundtrip(proc, rx, peer, desc, kv):
    proc.start_send("decode", desc)
    got, _ = rx.recv(peer, kv, wait=10.0)
    assert proc.result()[0] == "sent"
    expected = proc.cache()
    for layer in range(*desc.layers):
        for s, d in zip(desc.src_block_ids, desc.dst_block_ids, strict=True):
            assert torch.equal(kv[layer][:, d], expected[layer][:, s])
    return got


def test_sender_killed_before_sending_then_new_peer_works(registry, procs):
    doomed, fresh = procs(seed=1), procs(seed=2)  # spawn both now: startup overlaps
    rx = KVTransfer(registry)
    kv = make_cache(16, seed=0)
    registry.join("p-doomed", doomed.host("decode"))
    roundtrip(doomed, rx, "p-doomed", make_descriptor("warm", [1, 2], [3, 4]), kv)

    doomed.kill()
    start = time.perf_counter()
    with pytest.raises(TransferError) as info:
        rx.recv("p-doomed", kv, wait=DEADLINE)
    assert time.perf_counter() - start < DEADLINE
    assert isinstance(info.value, PeerLost)  # its store died with it: detected at once
    registry.remove("p-doomed")

    registry.join("p-fresh", fresh.host("decode"))
    desc = make_descriptor("after", [5, 0, 9], [1, 10, 2])
    assert roundtrip(fresh, rx, "p-fresh", desc, kv) == desc


def test_sender_killed_while_sending(registry, procs):
    proc = procs(seed=3, num_blocks=BIG)
    rx = KVTransfer(registry)
    kv = make_cache(BIG, seed=0)
    registry.join("p", proc.host("decode"))
    roundtrip(proc, rx, "p", make_descriptor("warm", [1], [1]), kv)

    proc.start_send("decode", make_descriptor("big", list(range(BIG)), list(range(BIG))))

    def kill_mid_transfer(desc) -> bool:
        proc.kill()  # announced, its payload on the way: the sender dies inside send()
        return True

    start = time.perf_counter()
    with pytest.raises(
        TransferError, match="receiving request big: the connection to peer 'p' broke"
    ):
        rx.recv("p", kv, wait=10.0, accept=kill_mid_transfer)
    assert time.perf_counter() - start < DEADLINE
    # The next call finds the peer's store gone: the peer is lost, not just reset.
    with pytest.raises(PeerLost, match="the store of peer 'p' is unreachable"):
        rx.recv("p", kv, wait=DEADLINE)
    assert time.perf_counter() - start < DEADLINE


def test_hung_sender_times_out_then_the_pair_recovers(registry, procs):
    proc = procs(seed=4, num_blocks=BIG)
    rx = KVTransfer(registry)
    kv = make_cache(BIG, seed=0)
    registry.join("p", proc.host("decode"))
    roundtrip(proc, rx, "p", make_descriptor("warm", [1], [1]), kv)

    proc.start_send("decode", make_descriptor("big", list(range(BIG)), list(range(BIG))))

    def freeze(desc) -> bool:
        proc.freeze()  # announced, its payload on the way: the sender stops inside send()
        return True

    start = time.perf_counter()
    try:
        with pytest.raises(TransferTimeout, match="no progress from peer 'p'"):
            rx.recv("p", kv, wait=10.0, accept=freeze)
        elapsed = time.perf_counter() - start
        assert DEADLINE * 0.9 <= elapsed < DEADLINE + 1.5
    finally:
        proc.thaw()
    status, *info = proc.result()
    assert status == "error"  # the receiver tore its group down: the sender's send fails

    # Same peer, no new address: the next transfer rebuilds the group under a new epoch.
    desc = make_descriptor("again", [7, 8, 8000], [0, 500, 8191])
    assert roundtrip(proc, rx, "p", desc, kv) == desc
    assert registry.get("p").pg_epoch == 1


def test_two_senders_one_dies_the_other_keeps_working(registry, procs):
    a, b = procs(seed=5), procs(seed=6)
    rx = KVTransfer(registry)
    kv_a, kv_b = make_cache(16, seed=0), make_cache(16, seed=1)
    registry.join("a", a.host("decode"))
    registry.join("b", b.host("decode"))

    # Both groups busy at the same time: one receiving thread per peer.
    errors: list[BaseException] = []

    def receive_from(proc, peer, kv, rounds):
        try:
            for i in range(rounds):
                roundtrip(
                    proc,
                    rx,
                    peer,
                    make_descriptor(f"{peer}{i}", [i, 15 - i], [2 * i, 2 * i + 1]),
                    kv,
                )
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=receive_from, args=(a, "a", kv_a, 3)),
        threading.Thread(target=receive_from, args=(b, "b", kv_b, 3)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors

    a.kill()
    start = time.perf_counter()
    with pytest.raises(PeerLost):
        rx.recv("a", kv_a, wait=DEADLINE)
    assert time.perf_counter() - start < DEADLINE + 0.5
    registry.remove("a")

    for i in range(3):
        desc = make_descriptor(f"b-after-{i}", [i + 3], [i + 8])
        assert roundtrip(b, rx, "b", desc, kv_b) == desc
