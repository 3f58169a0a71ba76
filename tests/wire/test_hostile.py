"""Hostile bytes to every decoder of a peer's message: a clear RefitProtocolError, no code execution.

Decoders: the staged transport's requests and replies (``refit_verify.wire.staged``), the broadcast
messages and rank reports, the sharded-digest metadata and roots (``refit_verify.wire.collective``), and
``refit_verify.manifest.from_wire`` (worker manifests fetched over ``collective_rpc`` / HTTP).
Payloads: garbage, a pickle that creates a file when unpickled (the test first proves it does, then
that no decoder made it), lengths announcing 4 GiB, messages of every other kind (wrong tags), and
valid msgpack of the wrong shape.

Then the same over a real two-process gloo group: a hostile sender rank broadcasts an oversized
length, a pickle, garbage, a transport message, a bucket announcing more bytes than its entries,
and a bucket with a misaligned and an overlapping entry; a hostile receiver rank answers a real
sender with a pickle or an oversized length; a hostile rank feeds a real ``sharded_digest`` a
pickle as metadata, a pickle as roots, and the wrong number of roots.
"""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest
import torch

from tests.support.dist_utils import init_rank, rank_result, spawn_ranks

from refit_verify.wire.collective import (BROADCAST_PROTOCOL, MAX_SHARD_MESSAGE_BYTES, BroadcastAbort, BroadcastComplete, BroadcastHello,
                                    Bucket, RankReport, ShardMeta, ShardRoots, decode_broadcast, decode_rank_report,
                                    decode_shard_meta, decode_shard_roots)
from refit_verify.errors import RefitProtocolError
from refit_verify.manifest import ModuleManifest, SessionManifest, WorkerIdentity, digest_map, digest_map_text, from_wire, to_text, to_wire
from refit_verify.wire.staged import (PROTOCOL_VERSION, Abort, Ack, Buffer, Complete, Done, Hello, Reject, ShmHandle, Welcome, decode_reply, decode_request)
from refit_verify.wire.fields import MAX_MESSAGE_BYTES, Entry, encode


class _Plant:
    """Unpickling this creates the file ``path`` (``open(path, "w")``): a stand-in for any code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def live_pickle(path: str) -> bytes:
    """A pickle payload that would create ``path`` if unpickled; checked to really do so."""
    payload = pickle.dumps(_Plant(path))
    assert not os.path.exists(path)
    pickle.loads(payload).close()  # the proof that the payload is live
    assert os.path.exists(path)
    os.unlink(path)
    return payload


SESSION = SessionManifest(session="s1", version=3, opened_by="transport", worker=WorkerIdentity(rank=0),
                          modules={"model": ModuleManifest(digests={"w": "0" * 32})})

# one valid message of every kind; each decoder must refuse all those not of its own kind
VALID = {
    "hello": Hello(protocol=PROTOCOL_VERSION, refit_id="ab" * 16, mode="enforce", alignment=512),
    "buffer": Buffer(seq=0, handle=ShmHandle(name="rv_x", nbytes=512), entries=[Entry(name="w", dtype="float32", shape=[4], offset=0, nbytes=16)],
                     used_bytes=512),
    "complete": Complete(n_tensors=1),
    "abort": Abort(reason="x"),
    "welcome": Welcome(protocol=PROTOCOL_VERSION, mode="off", reason=None),
    "ack": Ack(seq=0),
    "done": Done(manifest={"w": "0" * 32}, error=None, rejected=None, tensors=1, bytes=16, digest_s=0.0, session=SESSION),
    "reject": Reject(reason="no"),
    "broadcast_hello": BroadcastHello(protocol=BROADCAST_PROTOCOL, refit_id="ab" * 16, mode="log", alignment=512),
    "bucket": Bucket(seq=0, entries=[Entry(name="w", dtype="float32", shape=[4], offset=0, nbytes=16)], used_bytes=512),
    "broadcast_complete": BroadcastComplete(n_tensors=1),
    "broadcast_abort": BroadcastAbort(reason="x"),
    "rank_report": RankReport(rank=1, manifest={"w": "0" * 32}, error=None, rejected=None, tensors=1, bytes=16, digest_s=0.0),
    "shard_meta": ShardMeta(dtype="bfloat16", shape=[8, 4]),
    "shard_roots": ShardRoots(roots=[(1, 2), ((1 << 64) - 1, 0)]),
}

# decoder name -> (decode, the kinds it accepts)
DECODERS = {
    "request": (decode_request, {"hello", "buffer", "complete", "abort"}),
    "reply": (decode_reply, {"welcome", "ack", "done", "reject"}),
    "broadcast": (decode_broadcast, {"broadcast_hello", "bucket", "broadcast_complete", "broadcast_abort"}),
    "rank_report": (decode_rank_report, {"rank_report"}),
    "shard_meta": (decode_shard_meta, {"shard_meta"}),
    "shard_roots": (decode_shard_roots, {"shard_roots"}),
}

GARBAGE = {
    "empty": b"",
    "nul": b"\x00",
    "ff": b"\xff" * 64,
    "random": bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(7), dtype=torch.uint8).tolist()),
    "str32-4GiB": b"\x92\xa6bucket\xdb\xff\xff\xff\xff",
    "array32-4G": b"\x94\xa6bucket\x00\xdd\xff\xff\xff\xff",
    "map32-4G": b"\x92\xabrank_report\xdf\xff\xff\xff\xff",
    "bin32-4GiB": b"\xc6\xff\xff\xff\xff",
    "nested-depth": b"\x91" * 100_000,
    "trailing": encode(VALID["shard_meta"]) + b"\x00",
    "unknown-tag": msgspec.msgpack.encode(["nope", 1, 2]),
    "map-not-array": msgspec.msgpack.encode({"type": "bucket", "seq": 0, "entries": [], "used_bytes": 0}),
    "missing-field": msgspec.msgpack.encode(["bucket", 0, []]),
    "extra-field": msgspec.msgpack.encode(["broadcast_complete", 1, 2]),
    "wrong-types": msgspec.msgpack.encode(["bucket", "zero", [], 0]),
    "negative": msgspec.msgpack.encode(["broadcast_complete", -1]),
    "bad-mode": msgspec.msgpack.encode(["broadcast_hello", BROADCAST_PROTOCOL, "x", "ENFORCE", 512]),
    "bad-alignment": msgspec.msgpack.encode(["broadcast_hello", BROADCAST_PROTOCOL, "x", "off", 48]),
    "bad-dtype": msgspec.msgpack.encode(["shard_meta", "Float32!", [4]]),
    "negative-root": msgspec.msgpack.encode(["shard_roots", [[-1, 0]]]),
    "root-not-pair": msgspec.msgpack.encode(["shard_roots", [[1, 2, 3]]]),
    "huge-name": msgspec.msgpack.encode(["bucket", 0, [["a" * 5000, "float32", [], 0, 4]], 512]),
    "too-many-dims": msgspec.msgpack.encode(["shard_meta", "float32", [1] * 65]),
    "report-digest-not-str": msgspec.msgpack.encode(["rank_report", 1, {"w": 5}, None, None, 0, 0, 0.0, None]),
    "report-pickled-error": msgspec.msgpack.encode(["rank_report", 1, {}, pickle.dumps({"a": 1}), None, 0, 0, 0.0]),
}


@pytest.fixture
def marker(tmp_path) -> str:
    return str(tmp_path / "pickle-was-executed")


def _cases(pickle_payload: bytes) -> dict[str, bytes]:
    out = dict(GARBAGE)
    out["pickle"] = pickle_payload
    out["pickle-in-msgpack-bin"] = msgspec.msgpack.encode(["bucket", 0, pickle_payload, 0])
    return out


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_every_decoder_refuses_hostile_bytes(decoder, marker):
    decode, accepts = DECODERS[decoder]
    payload = live_pickle(marker)
    for name, data in _cases(payload).items():
        with pytest.raises(RefitProtocolError, match="undecodable|exceeds") as ei:
            decode(data)
        assert len(str(ei.value)) < 2000, name  # a clear message, not a dump of the input
    for kind, msg in VALID.items():
        data = encode(msg)
        if kind in accepts:
            assert decode(data) == msg, kind
        else:
            with pytest.raises(RefitProtocolError, match="undecodable"):
                decode(data)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_every_decoder_refuses_oversized_input_before_decoding(decoder):
    decode, accepts = DECODERS[decoder]
    limit = MAX_SHARD_MESSAGE_BYTES if decoder.startswith("shard") else MAX_MESSAGE_BYTES
    with pytest.raises(RefitProtocolError, match=f"exceeds the {limit}-byte limit"):
        decode(memoryview(b"\xc4\x00" + bytes(limit)))
    for bad in ("text", None, 12, ["hello"]):
        with pytest.raises(RefitProtocolError, match="expected bytes"):
            decode(bad)


def test_from_wire_refuses_hostile_manifests(marker):
    """Worker manifests arrive as JSON text (``to_text``) or builtins (vLLM's msgpack, JSON over
    HTTP, Ray): bytes, a pickle, wrong tags, wrong shapes and wrong types are each a
    RefitProtocolError naming the record."""
    assert from_wire(to_wire(SESSION)) == SESSION
    text = to_text(SESSION)
    assert isinstance(text, str) and from_wire(text) == SESSION and from_wire(text.encode()) == SESSION
    payload = live_pickle(marker)
    good = to_wire(SESSION)
    hostile = {name: data for name, data in _cases(payload).items()}
    hostile.update({
        "decoded-untyped": msgspec.msgpack.decode(encode(VALID["rank_report"])),
        "other-record": to_wire(ModuleManifest(digests={})),
        "wrong-tag": {**good, "type": "rank_report"},
        "unknown-field": {**good, "__reduce__": [1]},
        "missing-field": {k: v for k, v in good.items() if k != "worker"},
        "wrong-type": {**good, "version": "three"},
        "pickle-in-field": {**good, "errors": [payload]},
        "digests-not-map": {**good, "modules": {"model": {"digests": [["w", "0" * 32]]}}},
        "list": [good],
        "none": None,
        "str": "session_manifest",
        "text-truncated": text[:-1],
        "text-wrong-tag": text.replace('"type":"session_manifest"', '"type":"rank_report"'),
        "text-unknown-field": text[:-1] + ',"__reduce__":[1]}',
        "text-wrong-type": to_text(SESSION).replace('"version":', '"version":"three","x":', 1),
        "text-other-record": to_text(ModuleManifest(digests={})),
    })
    for name, data in hostile.items():
        with pytest.raises(RefitProtocolError, match="malformed SessionManifest"):
            from_wire(data)


def test_digest_maps_from_workers_are_read_strictly(marker):
    """Per-tensor digests a worker RPC returns (native manifest, transport and broadcast receives) are
    JSON text; text, builtins and None are read, anything else is a RefitProtocolError."""
    want = {"w": "0" * 32, "b": "f" * 32}
    assert digest_map(digest_map_text(want)) == want and digest_map(want) == want
    assert digest_map(None) is None and digest_map_text(None) is None and digest_map(digest_map_text({})) == {}
    for bad in ("not json", '["w"]', '{"w": 1}', {"w": 1}, {1: "0" * 32}, [("w", "0" * 32)], live_pickle(marker), 3):
        with pytest.raises(RefitProtocolError, match="malformed digest map"):
            digest_map(bad)
    assert not os.path.exists(marker)


# ------------------------------------------------------------------------------ over a real gloo group

WORLD = 2


def _raw_broadcast(data: bytes | None, length: int | None = None) -> None:
    """The hostile sender's side of one length-first message: a length, then (if given) bytes."""
    import torch.distributed as dist

    n = len(data) if length is None else length
    dist.broadcast(torch.tensor([n], dtype=torch.int64), src=0)
    if data is not None:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)


def _raw_gather_lengths(n: int) -> list[int]:
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(out, torch.tensor([n], dtype=torch.int64))
    return [int(x) for x in out]


def _raw_gather(data: bytes, *, all_ranks: bool = False) -> None:
    """The hostile rank's side of gather_messages / all_gather_messages with bytes of its own."""
    import torch.distributed as dist

    longest = max(_raw_gather_lengths(len(data)))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if all_ranks:
        dist.all_gather([torch.empty_like(buf) for _ in range(WORLD)], buf)
    else:
        dist.gather(buf, None, dst=0)


def _follow_refit() -> None:
    """A receiver that reads a real sender's messages and bucket bytes, up to the complete."""
    import torch.distributed as dist

    from refit_verify.wire.collective import broadcast_message

    while True:
        msg = broadcast_message(None, group=None, src=0, device=torch.device("cpu"), decode=decode_broadcast,
                                max_bytes=MAX_MESSAGE_BYTES, what="message")
        if isinstance(msg, Bucket):
            dist.broadcast(torch.empty(msg.used_bytes, dtype=torch.uint8), src=0)
        elif isinstance(msg, BroadcastComplete):
            return


def _outcome(fn) -> dict:
    try:
        return {"result": fn()}
    except Exception as e:  # noqa: BLE001 - recorded for the parent
        return {"type": type(e).__name__, "message": str(e)}


def _hostile_worker(rank: int, port: int, out_dir: str, payload: bytes) -> None:
    import torch.distributed as dist

    from refit_verify import RefitConfig
    from refit_verify.collective.broadcast import BroadcastReceiver, BroadcastSender
    from refit_verify.wire.collective import all_gather_messages, broadcast_message, gather_messages
    from refit_verify.collective.sharded import sharded_digest

    init_rank(rank, WORLD, port, one_numba_thread=True)
    cpu = torch.device("cpu")
    tensors = [(f"w{i}", torch.randn(100, generator=torch.Generator().manual_seed(i))) for i in range(6)]

    def receive():
        got: list[str] = []
        res = BroadcastReceiver(group=None, src=0).receive(lambda b: got.extend(n for n, _ in b))
        return {"rejected": res.rejected, "loaded": got, "manifest": sorted(res.manifest or {})}

    def send_msg(msg):
        broadcast_message(msg, group=None, src=0, device=cpu, decode=decode_broadcast, max_bytes=MAX_MESSAGE_BYTES, what="m")

    hello = BroadcastHello(protocol=BROADCAST_PROTOCOL, refit_id="ab" * 16, mode="enforce", alignment=512)
    with rank_result(out_dir, rank) as out:
        # 1. a hostile sender (rank 0), a real receiver (rank 1)
        for key, data, length in [("oversized_length", None, 1 << 40), ("pickle", payload, None), ("garbage", os.urandom(512), None),
                                  ("transport_message", encode(VALID["hello"]), None)]:
            out[key] = _outcome((lambda: _raw_broadcast(data, length)) if rank == 0 else receive)
            dist.barrier()

        def bucket_too_long():
            send_msg(hello)
            send_msg(Bucket(seq=0, entries=[Entry(name="w", dtype="float32", shape=[4], offset=0, nbytes=16)], used_bytes=1 << 40))

        out["bucket_too_long"] = _outcome(bucket_too_long if rank == 0 else receive)
        dist.barrier()

        def bad_layout():  # w0 fine, w1 misaligned, w2 overlaps w0's slot, w3 fine: w1 and w2 refused by name
            data = torch.arange(4 * 512, dtype=torch.uint8)
            ents = [Entry(name="w0", dtype="float32", shape=[4], offset=0, nbytes=16),
                    Entry(name="w1", dtype="float32", shape=[4], offset=520, nbytes=16),
                    Entry(name="w2", dtype="float32", shape=[4], offset=0, nbytes=16),
                    Entry(name="w3", dtype="float32", shape=[4], offset=1536, nbytes=16)]
            send_msg(hello)
            send_msg(Bucket(seq=0, entries=ents, used_bytes=2048))
            dist.broadcast(data[:2048].clone(), src=0)
            send_msg(BroadcastComplete(n_tensors=4))
            reports = gather_messages(None, group=None, dst=0, device=cpu, decode=decode_rank_report, max_bytes=MAX_MESSAGE_BYTES, what="r")
            return {"rejected": reports[1].rejected, "manifest": sorted(reports[1].manifest)}

        out["bad_layout"] = _outcome(bad_layout if rank == 0 else receive)
        dist.barrier()

        # 2. a real sender (rank 0), a hostile receiver (rank 1)
        def send():
            return sorted(BroadcastSender(group=None, src=0, config=RefitConfig(mode="enforce", buffer_bytes=4096)).send(tensors))

        def report_pickle():
            _follow_refit()
            _raw_gather(payload)

        def report_oversized():
            _follow_refit()
            _raw_gather_lengths(1 << 40)

        out["report_pickle"] = _outcome(send if rank == 0 else report_pickle)
        dist.barrier()
        out["report_oversized"] = _outcome(send if rank == 0 else report_oversized)
        dist.barrier()

        # 3. a real sharded digest (rank 0 holds all 8 rows, digests), a hostile rank 1 (0 rows)
        full = torch.arange(8, dtype=torch.float32)

        def digest():
            return sharded_digest(full, [8], dst=0).digest

        def meta_pickle():
            _raw_gather(payload, all_ranks=True)

        def valid_meta():
            all_gather_messages(ShardMeta(dtype="float32", shape=[0]), group=None, device=cpu, decode=decode_shard_meta,
                                max_bytes=MAX_SHARD_MESSAGE_BYTES, what="m")

        def roots_pickle():
            valid_meta()
            _raw_gather(payload)

        def roots_too_many():
            valid_meta()
            gather_messages(ShardRoots(roots=[(1, 2)] * 3), group=None, dst=0, device=cpu, decode=decode_shard_roots,
                            max_bytes=MAX_SHARD_MESSAGE_BYTES, what="r")

        for key, hostile in [("meta_pickle", meta_pickle), ("roots_pickle", roots_pickle), ("roots_too_many", roots_too_many)]:
            out[key] = _outcome(digest if rank == 0 else hostile)
            dist.barrier()
        out["marker_after"] = os.path.exists(os.path.join(out_dir, "pickle-was-executed"))
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp("hostile"))
    payload = live_pickle(os.path.join(out_dir, "pickle-was-executed"))
    return spawn_ranks(_hostile_worker, WORLD, out_dir, payload)


def test_hostile_sender_bytes_refused_by_the_broadcast_receiver(ranks):
    """Rank 0 sends hostile broadcast messages; the real receiver on rank 1 raises a clear
    RefitProtocolError for each, allocates nothing for an oversized length, unpickles nothing."""
    rx = ranks[1]
    want = {"oversized_length": "announced 1099511627776 bytes; accepted 1..67108864 (nothing allocated)",
            "pickle": "undecodable broadcast message", "garbage": "undecodable broadcast message",
            "transport_message": "undecodable broadcast message",
            "bucket_too_long": "bucket 0 announces 1099511627776 bytes but its entries end at byte 512"}
    for key, needle in want.items():
        assert rx[key]["type"] == "RefitProtocolError" and needle in rx[key]["message"], (key, rx[key])
        assert ranks[0][key] == {"result": None}
    assert not rx["marker_after"] and not ranks[0]["marker_after"]


def test_misaligned_and_overlapping_broadcast_entries_refused_by_name(ranks):
    """The broadcast receiver checks alignment and overlap, as the staged transport does: the bad
    entries are named in its report, the good ones load and are digested."""
    got = ranks[1]["bad_layout"]["result"]
    assert got["loaded"] == ["w0", "w3"] and got["manifest"] == ["w0", "w3"]
    assert got["rejected"] == {"w1": "offset 520 is not a multiple of the alignment 512",
                               "w2": "offset 0 overlaps the previous entry's slot (which ends at 512)"}
    assert ranks[0]["bad_layout"]["result"] == {"rejected": got["rejected"], "manifest": ["w0", "w3"]}


def test_hostile_rank_report_refused_by_the_sender(ranks):
    tx = ranks[0]
    assert tx["report_pickle"]["type"] == "RefitProtocolError"
    assert tx["report_pickle"]["message"].startswith("group rank 1: undecodable rank report")
    assert tx["report_oversized"]["type"] == "RefitProtocolError"
    assert "receiver reports: group ranks announced out-of-range lengths {1: 1099511627776}" in tx["report_oversized"]["message"]
    assert ranks[1]["report_pickle"] == ranks[1]["report_oversized"] == {"result": None}


def test_hostile_shard_messages_refused_by_sharded_digest(ranks):
    tx = ranks[0]
    assert tx["meta_pickle"]["type"] == "RefitProtocolError"
    assert tx["meta_pickle"]["message"].startswith("group rank 1: undecodable shard metadata")
    assert tx["roots_pickle"]["type"] == "RefitProtocolError"
    assert tx["roots_pickle"]["message"].startswith("group rank 1: undecodable shard roots")
    assert tx["roots_too_many"] == {"type": "RefitProtocolError",
                                    "message": "group rank 1 sent 3 chunk roots for its 0 bytes, expected 0"}


def test_to_text_falls_back_to_builtins_for_a_string_utf8_cannot_encode():
    """A record with an unpaired surrogate (a name, an OSError message about a non-UTF-8 path)
    cannot be JSON text; the worker returns it as builtins, which from_wire reads the same."""
    rec = SessionManifest(session="s1", version=1, opened_by="rpc", worker=WorkerIdentity(rank=0),
                          modules={"model": ModuleManifest(digests={"w\udc80": "0" * 32})}, errors=["open('/tmp/\udcff')"])
    out = to_text(rec)
    assert isinstance(out, dict) and from_wire(out) == rec
    assert isinstance(to_text(SESSION), str)


def test_per_tensor_records_are_left_out_of_the_cyclic_gc_and_decode_the_same():
    """A session's close builds and the trainer decodes one ParamState and one TensorState per
    tensor: declared ``gc=False`` (they hold only strings, numbers and lists of them, so they can
    close no reference cycle), they do not add to the young generation whose collections a refit
    pays for. Built or decoded, they are untracked and round-trip equal."""
    import gc

    from refit_verify.manifest import EngineSnapshot, EngineState, ParamState, TensorState

    ps = ParamState(status="verified", bytes=8, blocks=[("a.weight", "[0:2]")])
    ts = TensorState(digest="ab" * 16, ptr=4096, dtype="bfloat16", shape=[2, 2], written_version=3)
    snap = EngineSnapshot(worker=WorkerIdentity(rank=0), session="s", version=3, params={"a.weight": ts})
    state = EngineState(params={"a.weight": ps}, proven_bytes=8)
    back_snap = msgspec.json.decode(msgspec.json.encode(snap), type=EngineSnapshot)
    back_state = msgspec.json.decode(msgspec.json.encode(state), type=EngineState)
    assert (back_snap, back_state) == (snap, state)
    assert [gc.is_tracked(x) for x in (ps, ts, back_snap.params["a.weight"], back_state.params["a.weight"])] == [False] * 4
    assert gc.is_tracked(snap) and gc.is_tracked(ts.shape)  # only the per-tensor records themselves
