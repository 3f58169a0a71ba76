"""The broadcast messages' optional last fields (``BroadcastHello.version``, ``RankReport.stale``):
a message without them decodes as before; a version below 0 is refused at decode."""

from __future__ import annotations

import msgspec
import pytest

from refit_verify.errors import RefitProtocolError
from refit_verify.wire.collective import (BROADCAST_PROTOCOL, BroadcastHello, RankReport, decode_broadcast,
                                          decode_rank_report)


def test_a_header_without_a_version_is_unversioned_and_one_with_it_carries_it():
    legacy = msgspec.msgpack.encode(["broadcast_hello", BROADCAST_PROTOCOL, "r1", "enforce", 64])
    assert decode_broadcast(legacy).version is None
    hello = BroadcastHello(protocol=BROADCAST_PROTOCOL, refit_id="r1", mode="log", alignment=64, version=41)
    assert decode_broadcast(msgspec.msgpack.encode(hello)).version == 41
    with pytest.raises(RefitProtocolError):
        decode_broadcast(msgspec.msgpack.encode(["broadcast_hello", BROADCAST_PROTOCOL, "r1", "log", 64, -1]))


def test_a_rank_report_carries_why_its_session_was_out_of_order():
    legacy = msgspec.msgpack.encode(["rank_report", 1, {}, None, None, 0, 0, 0.0])
    assert decode_rank_report(legacy).stale is None
    rep = RankReport(rank=1, manifest={}, error=None, rejected=None, tensors=0, bytes=0, digest_s=0.0, stale="version 3 is older")
    assert decode_rank_report(msgspec.msgpack.encode(rep)).stale == "version 3 is older"
