"""The slave's estimate of when the master sent a message (replication/send_clock.py)."""

from __future__ import annotations

from replication.send_clock import SendClock

OFFSET_S = 5000.0  # the master's clock minus ours (another host)
EPS_S = 1e-6  # a stamp's resolution


def _stamp(sent_ours: float) -> int:
    return round((sent_ours + OFFSET_S) * 1e6)


def test_a_message_that_waited_in_a_buffer_is_dated_by_its_send_time() -> None:
    clock = SendClock()
    # live: each message arrives 0.3-0.8 ms after it is sent
    for i, transit_s in enumerate((0.0008, 0.0003, 0.0005)):
        sent_ours = 100.0 + i * 0.1
        estimate = clock.sent_at(_stamp(sent_ours), sent_ours + transit_s)
        assert sent_ours - EPS_S <= estimate <= sent_ours + transit_s + EPS_S
    # paused for 6 s: messages sent at 100.3 and 100.4 arrive together at 106.4
    for sent_ours in (100.3, 100.4):
        estimate = clock.sent_at(_stamp(sent_ours), 106.4)
        assert abs(estimate - sent_ours) < 0.001  # within the shortest transit seen, not 6 s late


def test_unstamped_messages_are_dated_by_their_arrival() -> None:
    assert SendClock().sent_at(0, 42.0) == 42.0


def test_a_slower_clock_on_our_side_is_followed_and_a_faster_one_errs_early() -> None:
    slower = SendClock()
    slower.sent_at(_stamp(10.0), 10.001)
    # ours ran 1 ms slower since: the minimum follows, the estimate stays at most the arrival
    assert slower.sent_at(_stamp(20.0), 19.9995) <= 19.9995 + EPS_S
    faster = SendClock()
    faster.sent_at(_stamp(10.0), 10.001)
    # ours ran 5 ms faster: the estimate is early (knowledge ages sooner), never late
    assert faster.sent_at(_stamp(20.0), 20.006) < 20.006
