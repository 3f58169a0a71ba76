"""Check the blind (spec-only) digest v1 reimplementation against the vectors.

``tests/support/blind_reference.py`` was written from docs/digest-spec.md alone; this
file imports only it and the stdlib.  Vectors up to 64 KiB run by default (both
the numpy path and the plain-int scalar path); the larger ones are marked
slow (numpy path ~1 s, scalar path ~20 s for all of them).
"""

import json
import pathlib

import pytest

from tests.support import blind_reference as br

VECTORS = json.loads(
    (pathlib.Path(__file__).parents[1] / "vectors" / "digest_vectors.json").read_text()
)["vectors"]

SMALL_LIMIT = 64 * 1024          # default run: nbytes <= 64 KiB

SMALL = [v for v in VECTORS if v["nbytes"] <= SMALL_LIMIT]
LARGE = [v for v in VECTORS if v["nbytes"] > SMALL_LIMIT]


def _id(v):
    return f"{v['dtype']}{v['shape']}"


def _check(v, fn):
    data = br.vector_bytes(v["nbytes"], v["dtype"])
    assert len(data) == v["nbytes"]
    assert -(-len(data) // 8) == v["lanes"]
    assert fn(data, v["dtype"], tuple(v["shape"])) == v["digest"]


def test_vector_count():
    assert len(VECTORS) == 105
    assert len(SMALL) + len(LARGE) == len(VECTORS)


@pytest.mark.parametrize("v", SMALL, ids=_id)
def test_small_vectors_numpy(v):
    _check(v, br.digest)


@pytest.mark.parametrize("v", SMALL, ids=_id)
def test_small_vectors_scalar(v):
    _check(v, br.digest_scalar)


@pytest.mark.slow
@pytest.mark.parametrize("v", LARGE, ids=_id)
def test_large_vectors_numpy(v):
    _check(v, br.digest)


@pytest.mark.slow
@pytest.mark.parametrize("v", LARGE, ids=_id)
def test_large_vectors_scalar(v):
    _check(v, br.digest_scalar)


def test_worked_example_a1():
    rec = br.metadata_record("uint8", (3,), 3)
    assert rec.hex() == (
        "72656669742d7665726966792f6469676573742f7631" "00" "05" "75696e7438" "01"
        "0300000000000000" "0300000000000000"
    )
    assert len(rec) == 46
    assert br.seeds("uint8", (3,), 3) == (0xF3D1BFA6DAF271C4, 0x95D5F0CB8A99EFDC)
    lane = 0x0000000000110A03
    h0 = br.node(0, 0xF3D1BFA6DAF271C4, lane, 48)
    h1 = br.node(1, 0x95D5F0CB8A99EFDC, lane, 48)
    assert (h0, h1) == (0x39C20DC3E955180B, 0x840063D047BDA75A)
    assert br.digest(bytes([3, 10, 17]), "uint8", (3,)) == "37293b70c95990af5e069a1eff2708a7"


def test_tweaks_section_4_2():
    assert br.tweak(0, 0) == 0x9E3779B97F4A7C15
    assert br.tweak(0, 1) == 0x3C6EF372FE94F82A
    assert br.tweak(0, 48) == 0x489E4C815D41C005
    assert br.tweak(0, 49) == 0xE6D5C63ADC8C3C1A
    assert br.tweak(0, 50) == 0x850D3FF45BD6B82F
    assert br.tweak(1, 0) == 0x2C15E81951E98155
    assert br.tweak(1, 48) == 0xD67CBAE12FE0C545
    assert br.tweak(1, 50) == 0x12EBAE542E75BD6F


def test_worked_example_a2_heights():
    lanes = [0x342D261F18110A03, 0x6C655E575049423B, 0xA49D968F88817A73] + [0] * 13
    expected = {
        0: [[0x7D558416B2706DFC, 0x4E5268A48EED3D9D] + [0xB70FB2CC55AF013F] * 6,
            [0x12CCDCAA2619BB26] + [0x9D68E5AF4A4EF84C] * 3,
            [0x98BB3371D0FBDEB4, 0x5770A338AA3B4022],
            [0xDA95D747A4F4E044]],
        1: [[0xDEA0DA85AC113F53, 0xD51A1E4FBD47D2FF] + [0x2A7B67AF6C6AD50E] * 6,
            [0xF967E6A976F2A208] + [0xABF2CC8FE05E345E] * 3,
            [0x4C073F708E868F7E, 0xD6835149709FF483],
            [0x42A40489033CE9EF]],
    }
    for c in (0, 1):
        g = lanes
        for k in range(4):
            g = [br.node(c, g[2 * i], g[2 * i + 1], k) for i in range(8 >> k)]
            assert g == expected[c][k], (c, k)
    data = b"".join(x.to_bytes(8, "little") for x in lanes[:3])
    assert br.digest(data, "int64", (3,)) == "cd9e15b743f3682b84c046f0fc6d8511"
    assert br.digest_scalar(data, "int64", (3,)) == "cd9e15b743f3682b84c046f0fc6d8511"


def test_empty_a3():
    assert br.digest(b"", "uint8", (0,)) == "cf2af016f13729475a292f42282687bc"
    assert br.digest_scalar(b"", "uint8", (0,)) == "cf2af016f13729475a292f42282687bc"
