"""The reply senders (triton/replies.py): every reply sent once, off the submitting thread, several
at once; stop sends what is queued; a failing send takes no thread down."""

import threading
import time

import pytest

from triton_tlaloc.triton.replies import ReplySenders


def test_each_reply_is_sent_once_off_the_submitting_thread():
    queued = []
    senders = ReplySenders(2, on_queued=queued.append)
    sent, lock = [], threading.Lock()

    def send(i):
        with lock:
            sent.append((i, threading.current_thread().name))

    for i in range(200):
        senders.submit(lambda i=i: send(i))
    senders.stop()
    assert sorted(i for i, _ in sent) == list(range(200)), "each reply sent exactly once"
    assert {name for _, name in sent} <= {"tlaloc-reply-0", "tlaloc-reply-1"}
    assert len(queued) == 200 and min(queued) >= 0.0


@pytest.mark.parametrize("threads, overlap", [(2, True), (1, False), (0, False)])
def test_the_sends_of_a_call_overlap_with_two_threads(threads, overlap):
    """Two sends that can only finish together (a barrier of two) finish with two threads;
    with one thread, or none (the control), the first waits alone and times out."""
    barrier = threading.Barrier(2, timeout=0.5)
    done = []

    def send():
        try:
            barrier.wait()
            done.append(True)
        except threading.BrokenBarrierError:
            done.append(False)

    senders = ReplySenders(threads)  # 0: the submitting thread waits in the first send
    senders.submit(send)
    senders.submit(send)
    senders.stop()
    assert all(done) is overlap and len(done) == 2


def test_the_submitting_thread_does_not_wait_for_a_send():
    release = threading.Event()
    senders = ReplySenders(1)
    t0 = time.perf_counter()
    senders.submit(lambda: release.wait(5))
    assert time.perf_counter() - t0 < 0.1, "submit returned before the send finished"
    release.set()
    senders.stop()


def test_no_threads_sends_on_the_submitting_thread():
    names = []
    senders = ReplySenders(0)
    senders.submit(lambda: names.append(threading.current_thread().name))
    assert names == [threading.current_thread().name]


def test_stop_sends_every_queued_reply_then_later_ones_inline():
    sent = []
    senders = ReplySenders(2)
    for i in range(20):
        senders.submit(lambda i=i: (time.sleep(0.002), sent.append(i)))
    senders.stop()
    assert sorted(sent) == list(range(20)), "stop sent what was queued"
    senders.submit(lambda: sent.append(threading.current_thread().name))
    assert sent[-1] == threading.current_thread().name, "after stop: sent by the caller"


def test_a_failing_send_takes_no_thread_down():
    sent = []
    senders = ReplySenders(1)
    senders.submit(lambda: 1 / 0)
    senders.submit(lambda: sent.append("next"))
    senders.stop()
    assert sent == ["next"]


def test_negative_threads_are_refused_by_name():
    with pytest.raises(ValueError, match="reply threads -1"):
        ReplySenders(-1)
