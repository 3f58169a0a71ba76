"""Regenerate ``tests/vectors/digest_vectors.json`` from the pure-Python reference (digest v1).

Run from the repository root::

    python tests/vectors/generate.py            # rewrite the JSON (about 30 s)
    python tests/vectors/generate.py --check    # exit 1 if the JSON is stale

Inputs are defined by rule, never stored: byte i of the logical bytes is ``(7*i + 3) % 251``
(``% 2`` more for ``bool``), viewed as the vector's dtype and shape. See ``docs/digest-spec.md`` §10.

Source: ``docs/digest-spec.md`` §10; digests from ``refit_verify.digest.reference``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from refit_verify.digest import reference as ref

HERE = Path(__file__).resolve().parent
JSON_PATH = HERE / "digest_vectors.json"
REGENERATE = "python tests/vectors/generate.py"

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
}  # fmt: skip

COMMENT = (
    "refit-verify digest v1 known answers (docs/digest-spec.md section 10). Inputs are defined by "
    "rule, not stored: for a vector of nbytes N, byte i (0 <= i < N) of the tensor's logical "
    "row-major bytes is (7*i + 3) mod 251, and for dtype bool it is ((7*i + 3) mod 251) mod 2; "
    "the tensor is those bytes viewed (little-endian) as dtype with shape (complex64: float32 "
    "real/imaginary pairs). nbytes = numel * itemsize; lanes = ceil(nbytes / 8). digest is 32 hex: "
    "channel 0 then channel 1, each 16 hex big-endian. Regenerate with: " + REGENERATE
)

CHUNK = ref.CHUNK_LANES
BLOCK = ref.GROUP * ref.STRIDE  # 4096 lanes: one stride block


def cases() -> list[tuple[str, tuple[int, ...], str]]:
    """Return the vector cases ``(dtype, shape, why)`` in file order."""
    c: list[tuple[str, tuple[int, ...], str]] = []
    add = lambda dt, shape, why: c.append((dt, tuple(shape), why))  # noqa: E731

    # Empty and 0-dim.
    add("uint8", [0], "0 bytes: no lanes, no chunks; the finalised seed")
    add("float32", [0, 3], "0 elements, shape [0, 3]: differs from [3, 0] and [0] only in the seed")
    add("float32", [3, 0], "0 elements, shape [3, 0]")
    add("float32", [0], "0 elements, 1-D")
    add("float32", [], "0-dim (ndim 0), one element, 4 bytes: partial lane")
    add("int64", [], "0-dim, exactly one lane")
    add("bool", [], "0-dim bool, 1 byte")
    add("bfloat16", [], "0-dim bfloat16, 2 bytes")
    # Byte tails around one and a few lanes.
    for n in list(range(1, 18)) + [31, 32, 33, 63, 65]:  # 64 bytes: uint8 [64] below
        why = {1: "1 byte", 7: "lane - 1 byte", 8: "exactly one lane", 9: "lane + 1 byte: 2 lanes, 7 pad bytes",
               16: "two lanes", 17: "2 lanes + 1 byte"}.get(n, f"{n} bytes: byte tail {n % 8}")  # fmt: skip
        add("uint8", [n], why)
    for dt in ("int8", "bool", "float8_e4m3fn", "float8_e5m2"):
        add(dt, [1], f"1 byte as {dt}")
    # Every dtype, one small 2-D shape; then the same 64 bytes under every dtype.
    for dt in ITEMSIZE:
        add(dt, [3, 5], f"every dtype: {dt} [3, 5], {15 * ITEMSIZE[dt]} bytes")
    for dt in ITEMSIZE:
        if dt != "bool":
            add(dt, [64 // ITEMSIZE[dt]], f"same 64 bytes (8 lanes) labelled {dt}: dtype only in the seed")
    # Lane-count edges: groups (16), two fold levels (256), stride block (4096), fold levels, chunks.
    edges = {
        15: "group - 1 lane: one fold, 1 pad lane", 16: "exactly one group: one fold level",
        17: "group + 1: two fold levels, W = 2", 31: "2 groups - 1", 32: "two groups, W = 2",
        33: "two groups + 1, W = 3", 255: "256 - 1 lanes", 256: "16 groups: exactly two fold levels, W = 16",
        257: "256 + 1: three fold levels", 4095: "stride block - 1",
        4096: "one stride block (16 x 256 lanes): 3 fold levels",
        4097: "stride block + 1: 2 blocks at level 0, 4 fold levels", 8191: "two blocks - 1",
        8192: "exactly two stride blocks", 8193: "two blocks + 1: 3 blocks at level 0",
        65535: "16^4 - 1 lanes", 65536: "16^4 lanes: exactly four fold levels", 65537: "16^4 + 1: five fold levels",
        CHUNK - 1: "chunk - 1 lane", CHUNK: "exactly one chunk (2^20 lanes, 8 MiB): five full fold levels",
        CHUNK + 1: "chunk + 1: second chunk of one lane (root = the lane)",
        2 * CHUNK - 1: "two chunks - 1 lane: last chunk one lane short", 2 * CHUNK: "exactly two chunks",
        2 * CHUNK + 1: "two chunks + 1 lane: three chunks",
    }  # fmt: skip
    for n, why in edges.items():
        add("int64", [n], f"{n} lanes: {why}")
    add("uint8", [8 * CHUNK + 3], "chunk + 3 bytes: second chunk is one zero-padded partial lane")
    add("bfloat16", [1024, 4096], "realistic bf16 weight, exactly one chunk")
    add("float32", [4097], "odd length: 4097 float32 = 2048.5 lanes, 2 blocks at level 0")
    add("bfloat16", [3, 7], "bf16 with a partial lane (42 bytes)")
    add("float16", [1000], "fp16 [1000], 250 lanes")
    # Same numel (24 float32, 12 lanes), different shapes: only the seed differs.
    for shape in ([24], [1, 24], [24, 1], [2, 12], [12, 2], [3, 8], [8, 3], [4, 6], [6, 4], [2, 3, 4], [4, 3, 2],
                  [2, 2, 2, 3], [1, 1, 24]):  # fmt: skip
        add("float32", shape, "24 float32 elements, same bytes, shape in the seed")
    for shape in ([4096], [64, 64], [16, 256], [256, 16]):
        add("bfloat16", shape, "4096 bf16 elements (1024 lanes), same bytes, shape in the seed")
    assert len({(dt, sh) for dt, sh, _ in c}) == len(c), "duplicate case"
    return c


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    """Return ``numel × itemsize`` for a case."""
    return math.prod(shape) * ITEMSIZE[dtype]


def input_bytes(dtype: str, nbytes: int) -> bytes:
    """Return the rule's logical bytes: ``(7i + 3) mod 251`` (``mod 2`` more for bool)."""
    b = (np.arange(nbytes, dtype=np.int64) * 7 + 3) % 251
    if dtype == "bool":
        b %= 2
    return b.astype(np.uint8).tobytes()


def vector(dtype: str, shape: tuple[int, ...], why: str) -> dict:
    """Compute one vector with the reference."""
    n = nbytes_of(dtype, shape)
    d = ref.digest_bytes(input_bytes(dtype, n), dtype, shape)
    return {"dtype": dtype, "shape": list(shape), "nbytes": n, "lanes": -(-n // 8), "digest": d, "why": why}


def build(max_nbytes: int | None = None) -> list[dict]:
    """Compute all vectors (or only those up to ``max_nbytes`` bytes)."""
    return [vector(*cs) for cs in cases() if max_nbytes is None or nbytes_of(cs[0], cs[1]) <= max_nbytes]


def dumps(vectors: list[dict]) -> str:
    """Serialise deterministically: a header, then one vector per line."""
    head = {"_comment": COMMENT, "version": "refit-verify digest v1", "regenerate": REGENERATE}
    lines = [json.dumps(v, separators=(", ", ": ")) for v in vectors]
    body = ",\n  ".join(lines)
    h = json.dumps(head, indent=1)[:-2]
    return h + ',\n "vectors": [\n  ' + body + "\n ]\n}\n"


def load() -> dict:
    """Load the checked-in JSON."""
    return json.loads(JSON_PATH.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the JSON is stale")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    text = dumps(build())
    dt = time.perf_counter() - t0
    if args.check:
        ok = JSON_PATH.exists() and JSON_PATH.read_text() == text
        print(f"{'up to date' if ok else 'STALE: run ' + REGENERATE} ({dt:.1f} s)")
        return 0 if ok else 1
    JSON_PATH.write_text(text)
    print(f"wrote {len(json.loads(text)['vectors'])} vectors to {JSON_PATH} in {dt:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
