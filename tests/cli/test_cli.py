"""The command line's checkpoint commands: ``refit-verify digest`` and ``refit-verify compare``.

Checkpoints are real safetensors files written by ``safetensors.torch.save_file``; expected
digests come from :func:`refit_verify.tensor_digest` of the tensors in memory, so the manifest
is checked against an independent computation of every record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("rich")

from refit_verify import tensor_digest  # noqa: E402
from refit_verify.cli.checkpoint import (CheckpointManifest, compare, decode_manifest, digest_checkpoint, encode_manifest,  # noqa: E402
                                     load_manifest, read_manifest)
from refit_verify.cli.commands import main  # noqa: E402
from refit_verify.digest.batch import logical_bytes  # noqa: E402
from refit_verify.errors import RefitConfigError  # noqa: E402
from refit_verify.manifest import ModuleManifest, SessionManifest, WorkerIdentity, to_wire  # noqa: E402

SPEC = {  # name: (dtype, shape); byte i of a tensor is (7 * i + salt) mod 251
    "lm_head.weight": (torch.bfloat16, (6, 8)),
    "model.embed_tokens.weight": (torch.bfloat16, (6, 8)),
    "model.layers.0.mlp.down_proj.weight": (torch.float32, (3, 5)),
    "model.layers.0.self_attn.q_proj.weight": (torch.float16, (8, 8)),
    "model.norm.weight": (torch.float32, (8,)),
}
NAMES = sorted(SPEC)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = ((torch.arange(n, dtype=torch.int64) * 7 + salt) % 251).to(torch.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return {n: _tensor(dt, shape, salt) for salt, (n, (dt, shape)) in enumerate(SPEC.items())}


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    safetensors_torch.save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))
    return path


def _digest(capsys, src: Path, out: Path) -> CheckpointManifest:
    assert main(["digest", str(src), "-o", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"manifest: {out}" in err
    return read_manifest(out)


def _rows(out: str) -> list[list[str]]:
    """The body rows of the rich table in ``out``: cells of lines between the header rule and the bottom."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return [[c.strip() for c in line.strip("│").split("│")] for line in lines[start + 1:end]]


def _compare(capsys, a: Path, b: Path) -> tuple[int, str]:
    rc = main(["compare", str(a), str(b)])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.out + cap.err
    return rc, cap.out + cap.err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, weights) -> Path:
    return _save(tmp_path_factory.mktemp("ckpt") / "model.safetensors", weights)


def test_digest_file_records_every_tensor(tmp_path, capsys, ckpt, weights):
    """Each record holds the digest, data digest, dtype, shape and bytes of its tensor."""
    m = _digest(capsys, ckpt, tmp_path / "m.json")
    assert m.digest_spec == 1 and m.source == str(ckpt.resolve()) and m.files == ["model.safetensors"]
    assert list(m.tensors) == NAMES
    for n, t in weights.items():
        r = m.tensors[n]
        assert r.digest == tensor_digest(t)
        assert r.data_digest == tensor_digest(logical_bytes(t))
        assert (r.dtype, r.shape, r.bytes, r.file) == (str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size(),
                                                       "model.safetensors")
    assert m.total_bytes == 96 + 96 + 60 + 128 + 32
    assert decode_manifest(encode_manifest(m)) == m
    assert json.loads((tmp_path / "m.json").read_text())["type"] == "checkpoint_manifest"


def test_digest_progress_callback_counts_bytes(ckpt):
    ticks: list[int] = []
    m = digest_checkpoint(ckpt, device="cpu", progress=ticks.append)
    assert ticks == [m.tensors[n].bytes for n in NAMES]


def test_compare_equal_exits_0(tmp_path, capsys, ckpt):
    a = _digest(capsys, ckpt, tmp_path / "a.json")
    assert a.tensors
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "a.json")
    assert rc == 0
    assert "equal: 5 tensors, same names and digests" in out


def test_one_byte_change_named_with_both_digests(tmp_path, capsys, ckpt, weights):
    changed = dict(weights)
    t = weights["model.layers.0.mlp.down_proj.weight"].clone()
    t.view(torch.uint8).view(-1)[13] ^= 0x01
    changed["model.layers.0.mlp.down_proj.weight"] = t
    _digest(capsys, ckpt, tmp_path / "a.json")
    _digest(capsys, _save(tmp_path / "b.safetensors", changed), tmp_path / "b.json")
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "b.json")
    assert rc == 1
    assert _rows(out) == [["model.layers.0.mlp.down_proj.weight", "bytes", tensor_digest(weights["model.layers.0.mlp.down_proj.weight"]),
                           tensor_digest(t), "float32 [3, 5], other bytes"]]
    assert "differ: 1 names (1 bytes); 4 equal" in out


def test_renamed_tensor_is_only_in_a_and_only_in_b(tmp_path, capsys, ckpt, weights):
    renamed = {("model.final_norm.weight" if n == "model.norm.weight" else n): t for n, t in weights.items()}
    _digest(capsys, ckpt, tmp_path / "a.json")
    _digest(capsys, _save(tmp_path / "b.safetensors", renamed), tmp_path / "b.json")
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "b.json")
    d = tensor_digest(weights["model.norm.weight"])
    assert rc == 1
    assert _rows(out) == [["model.norm.weight", "only in A", d, "-", "renamed? B has the same tensor as model.final_norm.weight"],
                          ["model.final_norm.weight", "only in B", "-", d, "renamed? A has the same tensor as model.norm.weight"]]
    assert "differ: 2 names (1 only in A, 1 only in B); 4 equal" in out


def test_dtype_relabel_same_bytes(tmp_path, capsys, ckpt, weights):
    """bf16 bytes relabelled fp16: the digest differs (it binds the dtype), the data digest does not."""
    relabel = dict(weights)
    relabel["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].view(torch.float16)
    _digest(capsys, ckpt, tmp_path / "a.json")
    _digest(capsys, _save(tmp_path / "b.safetensors", relabel), tmp_path / "b.json")
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "b.json")
    assert rc == 1
    assert _rows(out) == [["model.embed_tokens.weight", "dtype", tensor_digest(weights["model.embed_tokens.weight"]),
                           tensor_digest(relabel["model.embed_tokens.weight"]), "bfloat16 -> float16, same bytes"]]


def test_shape_change_with_other_bytes(tmp_path, capsys, ckpt, weights):
    other = dict(weights)
    other["model.norm.weight"] = _tensor(torch.float32, (2, 4), 99)
    _digest(capsys, ckpt, tmp_path / "a.json")
    _digest(capsys, _save(tmp_path / "b.safetensors", other), tmp_path / "b.json")
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "b.json")
    assert rc == 1
    assert [r[:2] + r[4:] for r in _rows(out)] == [["model.norm.weight", "shape", "[8] -> [2, 4], other bytes"]]


def _shards(d: Path, weights: dict[str, torch.Tensor], index: dict | None) -> Path:
    first, second = NAMES[:2], NAMES[2:]
    d.mkdir()
    _save(d / "model-00001-of-00002.safetensors", {n: weights[n] for n in first})
    _save(d / "model-00002-of-00002.safetensors", {n: weights[n] for n in second})
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _index(names_first=NAMES[:2], names_second=NAMES[2:]) -> dict:
    wm = {n: "model-00001-of-00002.safetensors" for n in names_first}
    wm.update({n: "model-00002-of-00002.safetensors" for n in names_second})
    return {"metadata": {"total_size": 412}, "weight_map": wm}


def test_sharded_checkpoint_directory_equals_single_file(tmp_path, capsys, ckpt, weights):
    d = _shards(tmp_path / "hf", weights, _index())
    m = _digest(capsys, d, tmp_path / "sharded.json")
    assert m.files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert {n: r.file for n, r in m.tensors.items()} == _index()["weight_map"]
    assert m.digests() == {n: tensor_digest(t) for n, t in weights.items()}
    _digest(capsys, ckpt, tmp_path / "single.json")
    rc, out = _compare(capsys, tmp_path / "sharded.json", tmp_path / "single.json")
    assert rc == 0 and "equal: 5 tensors" in out


def test_sharded_directory_without_index_reads_every_shard(tmp_path, capsys, weights):
    m = _digest(capsys, _shards(tmp_path / "hf", weights, None), tmp_path / "m.json")
    assert m.digests() == {n: tensor_digest(t) for n, t in weights.items()}


def test_index_that_disagrees_with_the_shards_is_bad_input(tmp_path, capsys, weights):
    bad = _index()
    bad["weight_map"]["model.extra.weight"] = "model-00002-of-00002.safetensors"
    d = _shards(tmp_path / "hf", weights, bad)
    assert main(["digest", str(d), "-o", str(tmp_path / "m.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the index lists 1 tensors no file holds: model.extra.weight" in err and "Traceback" not in err
    assert not (tmp_path / "m.json").exists()
    moved = _index(NAMES[:1], NAMES[1:])  # a tensor of shard 1 filed under shard 2
    (d / "model.safetensors.index.json").write_text(json.dumps(moved))
    with pytest.raises(RefitConfigError, match=f"tensor '{NAMES[1]}' is in model-00001-of-00002.safetensors but the index puts it in "
                                               "model-00002-of-00002.safetensors"):
        digest_checkpoint(d, device="cpu", progress=False)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_file_is_bad_input(tmp_path, capsys, ckpt, damage):
    data = ckpt.read_bytes()
    f = tmp_path / "broken.safetensors"
    f.write_bytes(b"\xff" * 64 if damage == "garbage" else data[:-5])
    assert main(["digest", str(f), "-o", str(tmp_path / "m.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"refit-verify digest: error: {f}: not a readable safetensors file: ")
    assert "Traceback" not in err and not (tmp_path / "m.json").exists()


def test_digest_missing_path_is_bad_input(tmp_path, capsys):
    assert main(["digest", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert f"{tmp_path / 'nope'}: no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["tensors"]["model.norm.weight"].update(digest="abc"), "tensor 'model.norm.weight': Expected `str` matching regex '^[0-9a-f]{32}$' - at `$.digest`"),
    (lambda d: d["tensors"]["model.norm.weight"].update(bytes=31), "bytes 31 does not match float32 [8] (32 bytes)"),
    (lambda d: d["tensors"]["model.norm.weight"].update(dtype="float33"), "'float33' is not a torch dtype name"),
    (lambda d: d.update(digest_spec=2), "digest version 2; this refit-verify computes digest v1"),
    (lambda d: d.update(extra=1), "unknown field `extra`"),
    (lambda d: d.update(type="weights_manifest"), "unknown manifest type 'weights_manifest'"),
])
def test_malformed_manifest_is_bad_input(tmp_path, capsys, ckpt, edit, message):
    _digest(capsys, ckpt, tmp_path / "a.json")
    doc = json.loads((tmp_path / "a.json").read_text())
    edit(doc)
    (tmp_path / "b.json").write_text(json.dumps(doc))
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "b.json")
    assert rc == 2
    assert out.startswith(f"refit-verify compare: error: {tmp_path / 'b.json'}: ") and message in out


@pytest.mark.parametrize("text, message", [("{not json", "not JSON"), ("[1, 2]", "expected a JSON object (a manifest), got a JSON list"),
                                           ('{"w": "xyz"}', "entry 'w': 'xyz' is not a 32-character lowercase hex digest")])
def test_not_a_manifest_is_bad_input(tmp_path, capsys, text, message):
    (tmp_path / "b.json").write_text(text)
    (tmp_path / "a.json").write_text("{}")
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "b.json")
    assert rc == 2 and message in out
    rc, out = _compare(capsys, tmp_path / "a.json", tmp_path / "absent.json")
    assert rc == 2 and f"{tmp_path / 'absent.json'}: no such file" in out


def _session(digests: dict[str, str], drafter: dict[str, str] | None = None) -> dict:
    modules = {"model": ModuleManifest(digests=digests, params=5, written=5, calls=1)}
    if drafter:
        modules["drafter"] = ModuleManifest(digests=drafter)
    return to_wire(SessionManifest(session="s1", version=42, opened_by="rpc", worker=WorkerIdentity(rank=1, tp=1), modules=modules))


def test_session_and_plain_manifests_compare_with_checkpoint(tmp_path, capsys, ckpt, weights):
    """A worker's saved SessionManifest and a plain {name: hex} object compare with a checkpoint manifest."""
    _digest(capsys, ckpt, tmp_path / "ckpt.json")
    digests = {n: tensor_digest(t) for n, t in weights.items()}
    (tmp_path / "session.json").write_bytes(msgspec.json.encode(_session(digests)))
    (tmp_path / "plain.json").write_text(json.dumps(digests))
    rc, out = _compare(capsys, tmp_path / "ckpt.json", tmp_path / "session.json")
    assert rc == 0
    assert "B: session s1 version 42 from worker rank 1 (dp 0, tp 1, pp 0, cpu), 5 tensors" in out
    rc, out = _compare(capsys, tmp_path / "plain.json", tmp_path / "ckpt.json")
    assert rc == 0 and f"A: digests {tmp_path / 'plain.json'} (5 names), 5 tensors" in out

    bad = dict(digests, **{"lm_head.weight": "0" * 32})
    (tmp_path / "session.json").write_bytes(msgspec.json.encode(_session(bad, drafter={"mtp.w": "1" * 32})))
    rc, out = _compare(capsys, tmp_path / "ckpt.json", tmp_path / "session.json")
    assert rc == 1
    assert _rows(out) == [["lm_head.weight", "bytes", digests["lm_head.weight"], "0" * 32, ""],
                          ["drafter:mtp.w", "only in B", "-", "1" * 32, ""]]


def test_malformed_session_manifest_is_bad_input(tmp_path, capsys):
    doc = _session({"w": "a" * 32})
    del doc["worker"]
    (tmp_path / "s.json").write_text(json.dumps(doc))
    with pytest.raises(RefitConfigError, match="malformed SessionManifest from a worker: Object missing required field `worker`"):
        load_manifest(tmp_path / "s.json")


def test_compare_api_kinds(tmp_path, capsys, ckpt):
    _digest(capsys, ckpt, tmp_path / "a.json")
    a = load_manifest(tmp_path / "a.json")
    diff = compare(a, a)
    assert diff.ok and diff.equal == 5 and diff.counts == {}


def test_missing_cli_extra_prints_install_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err == "refit-verify compare: needs rich; install the command line's extra: pip install 'refit-verify[cli]'\n"


def test_console_script_digest_to_stdout(tmp_path, ckpt, weights):
    """The installed ``refit-verify`` script: ``-o -`` writes the manifest JSON to stdout, the summary to stderr."""
    exe = Path(sys.executable).with_name("refit-verify")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "refit_verify.cli.commands"]
    p = subprocess.run([*cmd, "digest", str(ckpt), "-o", "-"], capture_output=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    m = decode_manifest(p.stdout)
    assert m.digests() == {n: tensor_digest(t) for n, t in weights.items()}
    assert b"digested 5 tensors (412 B) from 1 file in " in p.stderr and b"manifest: standard output" in p.stderr
