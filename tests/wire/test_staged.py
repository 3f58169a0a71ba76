"""Wire messages: round trips, and rejection of anything that is not exactly one valid message."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest
import torch

from refit_verify.errors import RefitProtocolError
from refit_verify.wire.staged import (PROTOCOL_VERSION, Abort, Ack, Buffer, Complete, CudaIpcHandle, Done, Hello, Reject, ShmHandle, Welcome, decode_reply, decode_request)
from refit_verify.wire.fields import MAX_MESSAGE_BYTES, Entry, encode, torch_dtype

CUDA_HANDLE = CudaIpcHandle(
    handle=bytes(range(64)), storage_size_bytes=1 << 20, storage_offset_bytes=4096, dtype="uint8",
    size=[1 << 20], stride=[1], tensor_offset=0, ref_counter_handle=b"/torch_1234_5678_0",
    ref_counter_offset=3, event_handle=b"\x00" * 64, event_sync_required=True, device=0,
)

REQUESTS = [
    Hello(protocol=PROTOCOL_VERSION, refit_id="ab" * 16, mode="enforce", alignment=512),
    Buffer(seq=0, handle=ShmHandle(name="rv_0123abcd", nbytes=8192), used_bytes=1024, entries=[
        Entry(name="model.embed_tokens.weight", dtype="bfloat16", shape=[16, 8], offset=0, nbytes=256),
        Entry(name="scalar", dtype="float32", shape=[], offset=512, nbytes=4),
    ]),
    Buffer(seq=7, handle=CUDA_HANDLE, entries=[Entry(name="e", dtype="float8_e4m3fn", shape=[3, 0], offset=0, nbytes=0)], used_bytes=0),
    Buffer(seq=1, handle=msgspec.structs.replace(CUDA_HANDLE, event_handle=None, event_sync_required=False), entries=[], used_bytes=0),
    Complete(n_tensors=310),
    Abort(reason="ValueError: bad tensor"),
]
REPLIES = [
    Welcome(protocol=PROTOCOL_VERSION, mode="enforce", reason=None),
    Welcome(protocol=PROTOCOL_VERSION, mode="off", reason="verification is disabled on this receiver"),
    Ack(seq=-2),
    Ack(seq=12),
    Done(manifest={"a": "0" * 32, "b.c": "f" * 32}, error=None, rejected=None, tensors=2, bytes=10, digest_s=0.25),
    Done(manifest=None, error="buffer 3: load failed", rejected={"x": "sent twice in one refit"}, tensors=0, bytes=0, digest_s=0.0),
    Reject(reason="protocol 2 not supported"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    data = encode(msg)
    assert decode_request(data) == msg
    assert decode_request(memoryview(data)) == msg
    with pytest.raises(RefitProtocolError):
        decode_reply(data)  # a request is never a reply


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg):
    data = encode(msg)
    assert decode_reply(data) == msg
    with pytest.raises(RefitProtocolError):
        decode_request(data)


class _Boom:
    def __reduce__(self):
        return (open, (os.path.join(os.environ.get("TMPDIR", "/tmp"), "refit-verify-pickle-executed"), "w"))


GARBAGE = {
    "pickle-dict": pickle.dumps({"tag": "hello", "protocol": 1}),
    "pickle-reduce": pickle.dumps(_Boom()),
    "pickle-struct": pickle.dumps(Hello(protocol=2, refit_id="x", mode="off", alignment=512), protocol=2),
    "empty": b"",
    "nul": b"\x00",
    "ff": b"\xff" * 64,
    "random": bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).tolist()),
    "str32-4GiB": b"\xdb\xff\xff\xff\xff",
    "array32-4G": b"\x94\xa5hello\x01\xa1x\xdd\xff\xff\xff\xff",
    "trailing": encode(Complete(n_tensors=3)) + b"\x00",
    "map-not-array": msgspec.msgpack.encode({"type": "hello", "protocol": 1, "refit_id": "x", "mode": "off"}),
    "missing-field": msgspec.msgpack.encode(["hello", 1, "x"]),
    "extra-field": msgspec.msgpack.encode(["hello", 2, "x", "off", 512, "extra"]),
    "v1-hello": msgspec.msgpack.encode(["hello", 1, "x", "off"]),
    "alignment-0": msgspec.msgpack.encode(["hello", 2, "x", "off", 0]),
    "alignment-huge": msgspec.msgpack.encode(["hello", 2, "x", "off", 1 << 40]),
    "ack-seq-3": msgspec.msgpack.encode(["ack", -3]),
    "abort-huge-reason": msgspec.msgpack.encode(["abort", "x" * 70000]),
    "map32-4G": b"\x93\xa4done\xdf\xff\xff\xff\xff",
    "bin32-4GiB-handle": b"\x95\xa6buffer\x00\x9d\xa8cuda_ipc\xc6\xff\xff\xff\xff",
    "unknown-tag": msgspec.msgpack.encode(["nope", 1]),
    "negative-count": msgspec.msgpack.encode(["complete", -1]),
    "shm-path": msgspec.msgpack.encode(["buffer", 0, ["shm", "../etc/passwd", 10], [], 0]),
    "empty-name": msgspec.msgpack.encode(["buffer", 0, ["shm", "x", 10], [["", "float32", [], 0, 4]], 0]),
    "dtype-text": msgspec.msgpack.encode(["buffer", 0, ["shm", "x", 10], [["a", "Float32!", [], 0, 4]], 0]),
    "negative-dim": msgspec.msgpack.encode(["buffer", 0, ["shm", "x", 10], [["a", "float32", [-1], 0, 4]], 0]),
    "huge-name": msgspec.msgpack.encode(["buffer", 0, ["shm", "x", 10], [["a" * 5000, "float32", [], 0, 4]], 0]),
}


@pytest.mark.parametrize("data", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_and_pickles_are_rejected(data):
    marker = os.path.join(os.environ.get("TMPDIR", "/tmp"), "refit-verify-pickle-executed")
    with pytest.raises(RefitProtocolError):
        decode_request(data)
    with pytest.raises(RefitProtocolError):
        decode_reply(data)
    assert not os.path.exists(marker)


def test_oversized_message_rejected_before_decoding():
    big = encode(Reject(reason="x"))  # valid, but pretend it is huge
    with pytest.raises(RefitProtocolError, match="exceeds"):
        decode_reply(big, max_bytes=len(big) - 1)
    huge = b"\x00" * (MAX_MESSAGE_BYTES + 1)
    with pytest.raises(RefitProtocolError, match="exceeds"):
        decode_request(huge)
    with pytest.raises(RefitProtocolError, match="exceeds"):
        decode_reply(memoryview(huge))


def test_torch_dtype_restricted_to_real_dtypes():
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    assert torch_dtype("bool") is torch.bool
    assert torch_dtype("float") is torch.float32  # an alias, but a real dtype
    for bad in ["tensor", "cuda", "__class__", "_C", "", "load", "nn", "Tensor"]:
        with pytest.raises(RefitProtocolError):
            torch_dtype(bad)
