"""A sync group's members prove the plan's secret once the group stands (``awex.transport.group_auth``): a process
that joined in a rank's place (without the secret, or with another) fails the group on every rank before any byte
of a version moves; members that hold it form the group as before."""

from __future__ import annotations

import threading

import torch

from awex.transport import create_sync_group
from awex.transport.base import TransferError
from awex.transport.group_auth import intruders, tag
from awex.transport.net import free_port


def _form(secrets: list[str], timeout: float = 10.0) -> list[object]:
    """Each rank joins a gloo group on its thread with its secret: its group, or the error it raised."""
    port, out = free_port(), [None] * len(secrets)

    def join(rank: int) -> None:
        try:
            out[rank] = create_sync_group(rank, len(secrets), "127.0.0.1", port, timeout=timeout, secret=secrets[rank])
        except Exception as e:  # asserted by the caller
            out[rank] = e

    threads = [threading.Thread(target=join, args=(r,)) for r in range(len(secrets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


def test_members_that_hold_the_secret_form_the_group():
    groups = _form(["s3cret"] * 3)
    assert all(not isinstance(g, Exception) for g in groups), groups
    assert [(g.rank, g.world_size) for g in groups] == [(0, 3), (1, 3), (2, 3)]
    got = torch.zeros(4)
    sender = threading.Thread(target=lambda: [w.wait() for w in groups[0].exchange([(torch.arange(4.0), 1)], [])])
    sender.start()
    for w in groups[1].exchange([], [(got, 0)]):
        w.wait()
    sender.join(10)
    assert torch.equal(got, torch.arange(4.0))  # the group moves bytes


def test_a_member_with_another_secret_fails_the_group_on_every_rank():
    results = _form(["s3cret", "s3cret", "guessed"])
    assert all(isinstance(r, TransferError) for r in results), results
    assert "rank(s) [2]" in str(results[0]) and "did not prove the plan's secret" in str(results[0])


def test_a_member_that_proves_nothing_fails_the_others_by_their_deadline():
    results = _form(["s3cret", ""], timeout=8.0)  # rank 1 joins without taking part in the proof
    assert isinstance(results[0], TransferError) and "did not prove" in str(results[0])


def test_tags_bind_the_rank_and_the_group_size():
    assert tag("k", 0, 2) != tag("k", 1, 2) != tag("k", 1, 3)
    assert intruders([tag("k", 0, 2), tag("k", 1, 2)], "k") == []
    assert intruders([tag("k", 0, 2), tag("k", 0, 2)], "k") == [1]  # a copied tag is not another rank's
