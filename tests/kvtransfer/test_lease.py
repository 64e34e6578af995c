"""LeaseTable: exact expiry with an injected clock."""

from __future__ import annotations

import math

import pytest

from kvtransfer import Lease, LeaseError, LeaseTable


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock) -> LeaseTable:
    return LeaseTable(clock)


def test_grant_sets_expiry_from_clock(table, clock):
    lease = table.grant("r1", "decode-0", 5.0)
    assert lease == Lease("r1", "decode-0", 105.0)
    assert table.get("r1") == lease and "r1" in table and len(table) == 1


def test_double_grant_is_refused(table):
    table.grant("r1", "decode-0", 5.0)
    with pytest.raises(LeaseError, match="already holds a lease .*'decode-0'"):
        table.grant("r1", "decode-1", 5.0)


def test_expiry_boundary_is_exact(table, clock):
    table.grant("r1", "a", 5.0)
    assert table.expired(104.999) == []
    assert table.expired(105.0) == [Lease("r1", "a", 105.0)]  # live on [100, 105)
    assert table.expired(200.0) == []  # reported once: the caller frees blocks once
    assert len(table) == 0


def test_expired_defaults_to_clock_and_sorts_by_expiry_then_id(table, clock):
    table.grant("late", "a", 9.0)
    table.grant("b", "a", 3.0)
    table.grant("a", "b", 3.0)
    table.grant("live", "a", 50.0)
    clock.now = 109.0
    assert [lease.request_id for lease in table.expired()] == ["a", "b", "late"]
    assert table.get("live") == Lease("live", "a", 150.0)


def test_renew_moves_expiry_to_now_plus_seconds(table, clock):
    table.grant("r1", "a", 5.0)
    clock.now = 104.0
    assert table.renew("r1", 5.0) == Lease("r1", "a", 109.0)
    assert table.expired(108.0) == []
    assert table.expired(109.0) == [Lease("r1", "a", 109.0)]


def test_renew_of_lapsed_or_unknown_lease_fails(table, clock):
    with pytest.raises(LeaseError, match="holds no lease to renew"):
        table.renew("nope", 1.0)
    table.grant("r1", "a", 5.0)
    clock.now = 105.0  # lapsed, not yet collected by expired()
    with pytest.raises(LeaseError, match="lapsed at 105.0"):
        table.renew("r1", 5.0)
    assert table.expired() == [Lease("r1", "a", 105.0)]


def test_release_returns_the_lease_once(table):
    table.grant("r1", "a", 5.0)
    assert table.release("r1") == Lease("r1", "a", 105.0)
    assert table.release("r1") is None
    assert table.release("never") is None
    assert table.expired(1e9) == []
    table.grant("r1", "b", 1.0)  # the id is free again


def test_revoke_owner_ends_only_that_owners_leases(table):
    table.grant("r1", "peer-a", 5.0)
    table.grant("r2", "peer-b", 1.0)
    table.grant("r3", "peer-a", 2.0)
    assert table.revoke_owner("peer-a") == [
        Lease("r3", "peer-a", 102.0),
        Lease("r1", "peer-a", 105.0),
    ]
    assert len(table) == 1 and table.get("r2").owner == "peer-b"
    assert table.revoke_owner("peer-a") == []


@pytest.mark.parametrize("seconds", [0, -1.0, math.inf, math.nan])
def test_bad_durations_are_refused(table, seconds):
    with pytest.raises(ValueError, match="finite and > 0"):
        table.grant("r1", "a", seconds)
    table.grant("ok", "a", 1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        table.renew("ok", seconds)


def test_non_numeric_duration_is_refused(table):
    with pytest.raises(TypeError, match="must be a number"):
        table.grant("r1", "a", "5")


def test_lease_error_message_is_plain_text(table):
    table.grant("r1", "a", 1.0)
    with pytest.raises(LeaseError) as info:
        table.grant("r1", "a", 1.0)
    assert str(info.value).startswith("request 'r1' already holds")
