"""Registry and protocol behaviour with both sides in this process (sender on a thread).

Real two-process transfers and peer deaths are in test_transfer.py and test_faults.py; these
cover what needs no second process: backend choice, address checks, rejection and draining,
deadlines on both sides, epoch recovery and teardown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch

from kvtransfer import (
    AddressError,
    DescriptorError,
    GroupRegistry,
    KVTransfer,
    PeerLost,
    TransferError,
    TransferRejected,
    TransferTimeout,
    UnknownPeer,
    resolve_backend,
)
from kvtransfer.backends import route_to
from kvtransfer.pair import BoundedCaller, StoreHung
from tests.kvtransfer.peer import make_cache, make_descriptor

TIMEOUT = 2.0


class Background:
    """fn() on a thread; result() returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._box["value"] = fn()
        except BaseException as e:
            self._box["error"] = e

    def result(self, timeout: float = 10.0) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("background call did not finish")
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]


class Pair:
    """A host registry ("P", sends) and a joined registry ("D", receives) in this process."""

    def __init__(self, host_address: str = "127.0.0.1", **transfer_kwargs: Any) -> None:
        self.host = GroupRegistry("cpu", host=host_address, timeout=TIMEOUT)
        self.join = GroupRegistry("cpu", timeout=TIMEOUT)
        self.join.join("P", self.host.host("D"))
        self.tx = KVTransfer(self.host, **transfer_kwargs)
        self.rx = KVTransfer(self.join, **transfer_kwargs)
        self.src = make_cache(16, seed=1)
        self.dst = make_cache(12, seed=2)

    def send(self, desc, timeout: float = TIMEOUT) -> Background:
        return Background(lambda: self.tx.send("D", self.src, desc, timeout=timeout))

    def roundtrip(self, desc, **recv_kwargs: Any):
        sending = self.send(desc)
        got, stats = self.rx.recv("P", self.dst, wait=5.0, **recv_kwargs)
        return got, stats, sending.result()

    def assert_moved(self, desc) -> None:
        start, end = desc.layers
        for layer in range(start, end):
            for s, d in zip(desc.src_block_ids, desc.dst_block_ids, strict=True):
                assert torch.equal(self.dst[layer][:, d], self.src[layer][:, s])

    def close(self) -> None:
        self.join.close()
        self.host.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_bounded_caller_returns_raises_or_gives_up_on_one_thread():
    caller = BoundedCaller("t")
    threads = set()

    def answer() -> int:
        threads.add(threading.get_ident())
        return 41 + 1

    assert caller.call(answer, 1.0) == 42
    with pytest.raises(ZeroDivisionError):
        caller.call(lambda: 1 / 0, 1.0)
    release = threading.Event()
    start = time.perf_counter()
    with pytest.raises(StoreHung) as info:
        caller.call(lambda: release.wait(5.0), 0.1)
    assert time.perf_counter() - start < 1.0
    assert not info.value.done.is_set()  # the abandoned call is still running
    release.set()
    assert info.value.done.wait(1.0)  # and is seen to end
    assert caller.call(answer, 1.0) == 42
    assert len(threads) == 1 and threading.get_ident() not in threads  # one long-lived thread
    caller.close()
    caller._thread.join(1.0)
    assert not caller._thread.is_alive()


# ---- backend choice and addresses -----------------------------------------------------------
def test_resolve_backend():
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("gloo", "cpu") == "gloo"
    with pytest.raises(ValueError, match="moves cuda tensors but the KV cache is on cpu"):
        resolve_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="moves cpu tensors but the KV cache is on cuda"):
        resolve_backend("gloo", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="unknown transfer backend 'mpi'"):
        resolve_backend("mpi", "cpu")


def test_host_address_is_small_msgpack_dict_on_a_free_port():
    with GroupRegistry("cpu") as reg:
        a, b = reg.host("d0"), reg.host("d1")
        assert set(a) == {"host", "port", "group", "backend"} and a["backend"] == "gloo"
        assert a["port"] > 0 and a["port"] != b["port"] and a["group"] != b["group"]
        assert msgpack.unpackb(msgpack.packb(a)) == a
        assert reg.peers() == ["d0", "d1"]
        with pytest.raises(ValueError, match="already has a group"):
            reg.host("d0")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.pop("port"), r"missing \['port'\]"),
        (lambda a: a.update(port=0), "port must be an int in 1..65535"),
        (lambda a: a.update(host=""), "host must be a non-empty str"),
        (
            lambda a: a.update(backend="nccl"),
            "peer uses backend 'nccl' but this worker uses 'gloo'",
        ),
    ],
)
def test_join_validates_the_address(mutate, message):
    with GroupRegistry("cpu") as host, GroupRegistry("cpu") as join:
        address = host.host("d0")
        mutate(address)
        with pytest.raises(AddressError, match=message):
            join.join("p0", address)
        assert "p0" not in join


def test_unknown_and_removed_peers():
    with GroupRegistry("cpu") as reg:
        with pytest.raises(UnknownPeer, match="no group for peer 'x'"):
            reg.get("x")
        reg.host("x")
        reg.remove("x")
        reg.remove("x")  # idempotent
        with pytest.raises(UnknownPeer):
            reg.get("x")


def test_join_of_a_dead_address_fails_fast():
    with GroupRegistry("cpu", timeout=1.0) as host, GroupRegistry("cpu", timeout=1.0) as join:
        address = host.host("d0")
        host.remove("d0")  # store released: nothing listens on the port any more
        start = time.perf_counter()
        with pytest.raises(PeerLost, match="cannot reach the store of peer 'p0'"):
            join.join("p0", address)
        assert time.perf_counter() - start < 5.0


# ---- transfers --------------------------------------------------------------------------------
def outward_address() -> str | None:
    """This machine's address on its default route (not loopback), or None without one."""
    try:
        address = route_to("192.0.2.1", 9)  # UDP connect: picks the interface, sends nothing
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_pair_on_a_non_loopback_address_moves_exact_blocks():
    """Workers on different nodes advertise their node's address: the store and the gloo
    sockets must work over it, not only over loopback."""
    address = outward_address()
    if address is None:
        pytest.skip("no non-loopback interface")
    pair = Pair(host_address=address)
    try:
        desc = make_descriptor("r1", [15, 2, 9], [0, 11, 4], layers=(0, 3))
        got, _, _ = pair.roundtrip(desc)
        assert got == desc
        pair.assert_moved(desc)
        assert pair.host.host("D2")["host"] == address
    finally:
        pair.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # pipelined, all 3 layers in one message
        {"message_bytes": 1},  # one layer per message, double-buffered
        {"message_bytes": 1, "pipeline": False},  # one layer per message, no overlap
    ],
)
def test_transfer_variants_move_exact_blocks(kwargs):
    pair = Pair(**kwargs)
    try:
        desc = make_descriptor("r1", [15, 2, 9], [0, 11, 4], layers=(1, 4))
        got, stats, sent = pair.roundtrip(desc)
        assert got == desc
        pair.assert_moved(desc)
        expect_messages = 3 if kwargs else 1
        assert stats.num_messages == sent.num_messages == expect_messages
        assert stats.payload_bytes == sent.payload_bytes == desc.payload_bytes
    finally:
        pair.close()


def test_empty_transfer_carries_only_the_descriptor(pair):
    desc = make_descriptor("r0", [], [], missing=[], num_prompt_tokens=9)
    got, stats, sent = pair.roundtrip(desc)
    assert got == desc and sent.payload_bytes == 0 and sent.num_messages == 0
    assert sent.control_bytes > 0 and stats.control_bytes == sent.control_bytes


def test_accept_can_refuse_and_the_payload_is_drained(pair):
    before = [t.clone() for t in pair.dst]
    refused = make_descriptor("aborted", [1, 2], [3, 4])
    sending = pair.send(refused)
    with pytest.raises(TransferRejected, match="aborted from peer 'P' refused"):
        pair.rx.recv("P", pair.dst, wait=5.0, accept=lambda d: d.request_id != "aborted")
    sending.result()  # the sender completed normally
    assert all(torch.equal(a, b) for a, b in zip(pair.dst, before, strict=True))
    ok = make_descriptor("next", [5], [6])
    pair.roundtrip(ok)  # stream still aligned, same group
    pair.assert_moved(ok)


def test_receiver_refuses_a_descriptor_that_does_not_fit_its_cache(pair):
    sending = pair.send(make_descriptor("oob", [1], [40]))  # receiver has 12 blocks
    with pytest.raises(TransferRejected, match=r"block ids \[40\] are out of range"):
        pair.rx.recv("P", pair.dst, wait=5.0)
    sending.result()
    pair.roundtrip(make_descriptor("next", [5], [6]))


def test_sender_validates_before_anything_is_announced(pair):
    with pytest.raises(DescriptorError, match=r"sender block ids \[99\] are out of range"):
        pair.tx.send("D", pair.src, make_descriptor("bad", [99], [0]))
    assert pair.rx.pending("P") == 0


def test_only_host_sends_and_only_joiner_receives(pair):
    desc = make_descriptor("r", [0], [0])
    with pytest.raises(TransferError, match="only the host side"):
        pair.rx.send("P", pair.dst, desc)
    with pytest.raises(TransferError, match="only the joined side"):
        pair.tx.recv("D", pair.src, wait=0.1)


def test_receiver_wait_times_out_without_breaking_the_group(pair):
    pair.roundtrip(make_descriptor("warm", [0], [0]))
    start = time.perf_counter()
    with pytest.raises(TransferTimeout, match="no transfer announced by peer 'P'"):
        pair.rx.recv("P", pair.dst, wait=0.3)
    assert 0.3 <= time.perf_counter() - start < 1.5
    group = pair.join.get("P")
    epoch = group.pg_epoch
    pair.roundtrip(make_descriptor("after", [1], [1]))
    assert group.pg_epoch == epoch  # same group, not rebuilt


def test_sender_deadline_then_epoch_recovery(pair):
    pair.roundtrip(make_descriptor("warm", [0], [0]))
    big = _big(pair)
    start = time.perf_counter()
    with pytest.raises(TransferTimeout, match="sending request big: no progress"):
        # Nobody receives: the payload cannot leave within the deadline.
        pair.tx.send("D", pair.src, big, timeout=0.5)
    assert time.perf_counter() - start < 3.0
    assert pair.host.get("D").epoch() == 1  # the host moved the pair to a fresh epoch
    # The abandoned announcement names the receiver's live group, so it is taken without a
    # store round trip and fails fast: the sender has aborted that group.
    start = time.perf_counter()
    with pytest.raises(TransferError, match="receiving request big: the connection"):
        pair.rx.recv("P", pair.dst, wait=5.0)
    assert time.perf_counter() - start < 1.0
    # Both sides now rebuild the group under epoch 1.
    desc = make_descriptor("recovered", [3, 4], [5, 6])
    got, _, _ = pair.roundtrip(desc)
    assert got.request_id == "recovered"
    pair.assert_moved(desc)
    assert pair.join.get("P").pg_epoch == 1


def test_stale_announcement_without_a_group_is_skipped(pair):
    # The sender gives up before the receiver ever built a group: the receiver must not try
    # to build one for the abandoned epoch (nobody would come), it skips to the live one.
    with pytest.raises(TransferTimeout, match="building the group"):
        pair.tx.send("D", pair.src, make_descriptor("abandoned", [1], [1]), timeout=0.5)
    assert pair.host.get("D").epoch() == 1
    desc = make_descriptor("live", [2, 3], [4, 5])
    got, _, _ = pair.roundtrip(desc)
    assert got.request_id == "live"
    pair.assert_moved(desc)


def _big(pair: Pair):
    """A transfer large enough (2 MiB) not to fit in socket buffers; swaps in a bigger cache."""
    pair.src = make_cache(1024, seed=3)
    return make_descriptor("big", list(range(1024)), list(range(1024)))


def test_remove_during_wait_ends_the_transfer(pair):
    waiting = Background(lambda: pair.rx.recv("P", pair.dst, wait=5.0))
    time.sleep(0.2)
    pair.join.remove("P")
    with pytest.raises((PeerLost, TransferTimeout)):
        waiting.result(timeout=8.0)
    with pytest.raises(UnknownPeer):
        pair.rx.recv("P", pair.dst, wait=0.1)


def test_host_removal_releases_the_store(pair):
    pair.roundtrip(make_descriptor("warm", [0], [0]))
    pair.host.remove("D")
    start = time.perf_counter()
    with pytest.raises(PeerLost, match="the store of peer 'P' is unreachable"):
        pair.rx.recv("P", pair.dst, wait=1.0)
    assert time.perf_counter() - start < 1.0


def test_a_ray_worker_advertises_its_node_address():
    ray = pytest.importorskip("ray")
    from cluster.worker_actor import with_node_address

    assert with_node_address({"timeout_seconds": 5.0}) == {
        "timeout_seconds": 5.0,
        "advertise_host": ray.util.get_node_ip_address(),
    }
    chosen = {"advertise_host": "10.1.2.3"}
    assert with_node_address(chosen) is chosen
