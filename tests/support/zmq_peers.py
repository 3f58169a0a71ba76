"""Hand-made ZMQ peers for the transport's boundary tests (a stranger, a restarted sender)."""

from __future__ import annotations

import zmq


def bound_req(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    """A REQ socket bound at ``endpoint`` as a sender would be (linger 0, receive timeout 5 s, relaxed)."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.setsockopt(zmq.REQ_RELAXED, 1)
    req.bind(endpoint)
    return ctx, req
