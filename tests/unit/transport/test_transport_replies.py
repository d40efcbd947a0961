"""A message with a wrong protocol, a bad key or a bad envelope is answered (REJ, with its key frame
as sent and the reason), not left without a reply."""

from __future__ import annotations

import pytest
import zmq

from t1async.transport.transport import REJECT, ZmqReceiver


@pytest.mark.parametrize("frames, key, reason", [
    ([b"t1async/0", b"traj-1", b"frame"], b"traj-1", "protocol b't1async/0', expected 't1async/1'"),
    ([b"t1async/1", b"\xff\xfe", b"frame"], b"\xff\xfe", "key is not utf-8"),
    ([b"t1async/1", b"a\nb", b"frame"], b"a\nb", "is not 1-128 printable bytes"),
    ([b"t1async/1", b"traj-2"], b"traj-2", "envelope of 2 parts"),
    ([b"junk"], b"", "envelope of 1 parts"),
])
def test_a_malformed_message_gets_a_rej_with_its_reason(frames, key, reason):
    rx = ZmqReceiver("tcp://127.0.0.1:*")
    tx = zmq.Context.instance().socket(zmq.DEALER)
    tx.setsockopt(zmq.LINGER, 0)
    tx.connect(rx.endpoint)
    try:
        tx.send_multipart(frames)
        d = rx.recv(timeout_s=5)
        assert d is not None and d.error is not None and reason in d.error
        rx.ack(d, False, d.error)  # what the learner's inbox answers (t1async/transport/inbox.py)
        assert tx.poll(5000), "no reply to a malformed message"
        kind, got_key, got_reason = tx.recv_multipart()
        assert (kind, got_key) == (REJECT, key) and reason in got_reason.decode()
    finally:
        tx.close()
        rx.close()
