"""The scheduler actor's outbox: a batch of deltas is kept until its caller acknowledges it, so a call that
returns to a caller who is gone (a pump cancelled too late) loses nothing and a received batch never repeats."""

from cluster.scheduler_actor import _Outbox
from scheduler import RequestOutput


def delta(token: int) -> RequestOutput:
    return RequestOutput("r", 0, [token])


def test_nothing_to_send_until_a_delta_arrives():
    assert _Outbox().take(0) is None


def test_an_acknowledged_batch_is_not_sent_again():
    box = _Outbox()
    box.pending.append(delta(1))
    number, batch = box.take(0)
    assert (number, [d.new_token_ids for d in batch]) == (1, [[1]])
    assert box.take(number) is None
    box.pending.append(delta(2))
    assert [d.new_token_ids for d in box.take(number)[1]] == [[2]]


def test_a_batch_whose_caller_vanished_is_sent_again_with_what_came_since():
    box = _Outbox()
    box.pending.append(delta(1))
    box.take(0)  # taken by a call whose caller is gone: nobody acknowledges batch 1
    box.pending.append(delta(2))
    number, batch = box.take(0)
    assert number == 2 and [d.new_token_ids for d in batch] == [[1], [2]]
    number, batch = box.take(0)  # lost again: still everything, in order
    assert number == 3 and [d.new_token_ids for d in batch] == [[1], [2]]
    assert box.take(number) is None
