"""Digests of checkpoints on disk (safetensors), the checkpoint manifest, and manifest comparison.

A :class:`CheckpointManifest` records, for every tensor of a safetensors file or of a directory of
them (an HF checkpoint, sharded with ``model.safetensors.index.json`` or not), its digest v1
(:func:`refit_verify.tensor_digest`), dtype, shape and byte count. It is a msgspec record written
as JSON (:func:`encode_manifest`) and read back with validation (:func:`decode_manifest`): a
malformed or hand-edited file is a :class:`~refit_verify.errors.RefitConfigError` naming the file
and the offending field, never an object built from unchecked data.

:func:`load_manifest` reads any manifest the command line compares: a checkpoint manifest, a
worker's :class:`~refit_verify.manifest.SessionManifest` saved as JSON (``to_wire``), or a plain
JSON object ``{name: 32-hex}``; :func:`compare` names every difference between two of them.

Tensors are read with the ``safetensors`` library (``safe_open(..., framework="pt")``), one at a
time, so memory holds one tensor (plus what :class:`~refit_verify.trainer.exports.StreamDigests` keeps in
flight on CUDA).

The module stays whole past 500 lines: its three parts (the manifest record and its JSON, digests
of files on disk, comparison) are one file format, read and written in one place.

Source: ``docs/digest-spec.md`` (digest v1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from refit_verify.errors import RefitConfigError

__all__ = ["DIGEST_SPEC_VERSION", "CheckpointManifest", "Difference", "LoadedManifest", "ManifestDiff", "TensorRecord",
           "KINDS", "checkpoint_files", "compare", "decode_manifest", "digest_checkpoint", "encode_manifest", "load_manifest",
           "read_manifest", "write_manifest"]

DIGEST_SPEC_VERSION = 1
"""The digest version this refit-verify computes (``docs/digest-spec.md``); a manifest of another
version cannot be compared with ours."""

Hex32 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_OPTS = dict(forbid_unknown_fields=True, omit_defaults=False)


class TensorRecord(msgspec.Struct, **_OPTS):
    """One tensor of a checkpoint.

    Attributes:
        digest: digest v1 of the tensor (dtype name, shape and bytes), 32 lowercase hex.
        data_digest: digest v1 of its bytes alone, viewed as ``uint8[bytes]``: equal for two
            tensors holding the same bytes under another dtype or shape (a relabel).
        dtype: torch's dtype name without ``torch.`` (``"bfloat16"``), as the digest binds it.
        shape: the tensor's shape. bytes: its size in bytes (``numel * element size``).
        file: the safetensors file holding it, relative to the checkpoint's source.
    """

    digest: Hex32
    data_digest: Hex32
    dtype: Annotated[str, msgspec.Meta(pattern="^[a-z][a-z0-9_]*$")]
    shape: list[NonNeg]
    bytes: NonNeg
    file: str


class CheckpointManifest(msgspec.Struct, tag="checkpoint_manifest", **_OPTS):
    """Digests of every tensor of a checkpoint on disk.

    Attributes:
        digest_spec: the digest version of every digest here (:data:`DIGEST_SPEC_VERSION`).
        source: the checkpoint's path (absolute) when it was digested.
        files: the safetensors files read, relative to ``source`` (a file's own name when
            ``source`` is a file), in reading order.
        tensors: ``{tensor name: TensorRecord}`` in reading order.
        created_by: ``"refit-verify <version>"``.
    """

    digest_spec: int
    source: str
    files: list[str]
    tensors: dict[str, TensorRecord]
    created_by: str = ""

    def digests(self) -> dict[str, str]:
        """Return ``{tensor name: 32-hex digest}``."""
        return {n: r.digest for n, r in self.tensors.items()}

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors."""
        return sum(r.bytes for r in self.tensors.values())


# ------------------------------------------------------------------------------ encode / decode


def encode_manifest(m: CheckpointManifest) -> bytes:
    """Return ``m`` as indented JSON (UTF-8 bytes, one tensor per block, a final newline)."""
    return msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n"


def _itemsize(dtype: str) -> int | None:
    import torch

    dt = getattr(torch, dtype, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else None


def decode_manifest(data: bytes | str, source: str = "manifest") -> CheckpointManifest:
    """Rebuild a :class:`CheckpointManifest` from JSON, validating every field.

    Besides the field types, each record's ``bytes`` must equal ``prod(shape) * itemsize(dtype)``
    and its dtype must be a torch dtype; ``digest_spec`` must be :data:`DIGEST_SPEC_VERSION`.

    Args:
        data: the JSON text. source: the file's name, for messages.

    Raises:
        RefitConfigError: not JSON, not a checkpoint manifest, a wrong or missing field (named by
            its path, e.g. ``$.tensors.w.digest``), an inconsistent record, another digest version.
    """
    try:
        m = msgspec.json.decode(data, type=CheckpointManifest)
    except msgspec.ValidationError as e:
        raise RefitConfigError(f"{source}: not a valid checkpoint manifest: {_which_tensor(data, e)}") from None
    except msgspec.DecodeError as e:
        raise RefitConfigError(f"{source}: not JSON: {e}") from None
    _check_spec(m.digest_spec, source)
    for name, r in m.tensors.items():
        size = _itemsize(r.dtype)
        if size is None:
            raise RefitConfigError(f"{source}: tensor {name!r}: {r.dtype!r} is not a torch dtype name")
        if r.bytes != math.prod(r.shape) * size:
            raise RefitConfigError(f"{source}: tensor {name!r}: bytes {r.bytes} does not match {r.dtype} {r.shape} "
                                   f"({math.prod(r.shape) * size} bytes)")
    return m


def _which_tensor(data: bytes | str, e: msgspec.ValidationError) -> str:
    """msgspec writes a bad record's path as ``$.tensors[...]``: name the tensor."""
    if "$.tensors[...]" not in str(e):
        return str(e)
    try:
        records = msgspec.json.decode(data)["tensors"]
        for name, rec in records.items():
            try:
                msgspec.convert(rec, TensorRecord)
            except msgspec.ValidationError as inner:
                return f"tensor {name!r}: {inner}"
    except Exception:  # noqa: BLE001 - fall back to msgspec's own message
        pass
    return str(e)


def _check_spec(version: int, source: str) -> None:
    if version != DIGEST_SPEC_VERSION:
        raise RefitConfigError(f"{source}: digest version {version}; this refit-verify computes digest v{DIGEST_SPEC_VERSION} "
                               "and cannot compare other versions")


def write_manifest(m: CheckpointManifest, path: str | Path) -> Path:
    """Write ``m`` to ``path`` as JSON (replacing it atomically); return the path."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(encode_manifest(m))
    tmp.replace(p)
    return p


def _read(path: str | Path) -> bytes:
    p = Path(path)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise RefitConfigError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise RefitConfigError(f"{p}: a directory, not a manifest file") from None
    except OSError as e:
        raise RefitConfigError(f"{p}: cannot read: {e.strerror or e}") from None


def read_manifest(path: str | Path) -> CheckpointManifest:
    """Read and validate a checkpoint manifest file (see :func:`decode_manifest`).

    Raises:
        RefitConfigError: the file is missing or unreadable, or not a valid checkpoint manifest.
    """
    return decode_manifest(_read(path), str(path))


# ------------------------------------------------------------------------------ checkpoints on disk


def _index_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors.index.json"))


def checkpoint_files(path: str | Path) -> tuple[Path, list[Path], dict[str, str] | None]:
    """Return ``(root, safetensors files, weight map or None)`` of a checkpoint.

    ``path`` is a ``.safetensors`` file or a directory. A directory with an index
    (``model.safetensors.index.json``, or exactly one ``*.safetensors.index.json``) is read as the
    index says: its files, and ``weight_map`` ``{tensor name: file}``; without one, every
    ``*.safetensors`` in it, in name order.

    Raises:
        RefitConfigError: no such path; a directory without safetensors files; several indexes;
            an index that is not JSON, has no ``weight_map`` or names a missing file.
    """
    p = Path(path)
    if p.is_file():
        return p.parent, [p], None
    if not p.is_dir():
        raise RefitConfigError(f"{p}: no such file or directory")
    indexes = _index_files(p)
    preferred = p / "model.safetensors.index.json"
    if preferred.is_file():
        indexes = [preferred]
    if len(indexes) > 1:
        raise RefitConfigError(f"{p}: several safetensors indexes ({', '.join(i.name for i in indexes)}); digest one shard file "
                               "at a time or remove the others")
    if not indexes:
        files = sorted(f for f in p.glob("*.safetensors") if f.is_file())
        if not files:
            raise RefitConfigError(f"{p}: no *.safetensors files in this directory")
        return p, files, None
    idx = indexes[0]
    try:
        doc = json.loads(idx.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RefitConfigError(f"{idx}: not a readable JSON index: {e}") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise RefitConfigError(f"{idx}: no weight_map of tensor name to file name")
    names = list(dict.fromkeys(wmap.values()))
    bad = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
    if bad:
        raise RefitConfigError(f"{idx}: weight_map names files outside the checkpoint: {bad[:5]}")
    missing = [n for n in names if not (p / n).is_file()]
    if missing:
        raise RefitConfigError(f"{idx}: weight_map names {len(missing)} missing files: {', '.join(missing[:5])}")
    return p, [p / n for n in names], dict(wmap)


def _open(f: Path, device: str):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(f), framework="pt", device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise RefitConfigError(f"{f}: not a readable safetensors file: {e}") from None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _progress_bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # the library works without the cli extra: no bar
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None, leave=False, dynamic_ncols=True)


def digest_checkpoint(path: str | Path, *, device: str | None = None, progress: bool | Callable[[int], None] = True) -> CheckpointManifest:
    """Digest every tensor of a safetensors file or checkpoint directory.

    Args:
        path: a ``.safetensors`` file or a directory of them (see :func:`checkpoint_files`).
        device: where tensors are loaded and digested: ``"cuda"`` (the Triton kernels) or
            ``"cpu"``; default ``"cuda"`` when available.
        progress: True: a tqdm bar on stderr in bytes (when tqdm is installed and stderr is a
            terminal); False: none; a callable: called with the bytes of each digested tensor.

    Returns:
        CheckpointManifest: one record per tensor, in file then header order.

    Raises:
        RefitConfigError: a missing path or file, a corrupt or truncated safetensors file, a tensor
            name found in two files, an index whose ``weight_map`` disagrees with the files.
    """
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        __version__ = version("refit-verify")
    except PackageNotFoundError:  # a source tree without installed metadata
        __version__ = "0+unknown"
    from refit_verify.digest.tensors import dtype_name, logical_bytes
    from refit_verify.trainer.exports import StreamDigests

    root, files, wmap = checkpoint_files(path)
    device = device or _default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RefitConfigError("device cuda requested but CUDA is not available")
    src = Path(path).resolve()
    rel = [f.name if src.is_file() else f.relative_to(root).as_posix() for f in files]
    handles = [_open(f, device) for f in files]
    try:
        seen: dict[str, str] = {}
        plan: list[tuple[int, str]] = []
        total = 0
        for i, h in enumerate(handles):
            for name in h.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                if name in seen:
                    raise RefitConfigError(f"{src}: tensor {name!r} is in {seen[name]} and in {rel[i]}")
                if wmap is not None and wmap.get(name) != rel[i]:
                    where = f"the index puts it in {wmap[name]}" if name in wmap else "the index does not list it"
                    raise RefitConfigError(f"{src}: tensor {name!r} is in {rel[i]} but {where}")
                seen[name] = rel[i]
                sl = h.get_slice(name)
                plan.append((i, name))
                total += _slice_bytes(sl)
        if wmap is not None:
            absent = [n for n in wmap if n not in seen]
            if absent:
                raise RefitConfigError(f"{src}: the index lists {len(absent)} tensors no file holds: {', '.join(absent[:5])}")
        bar = _progress_bar(total, f"digest {src.name}") if progress is True else None
        tick = progress if callable(progress) else (bar.update if bar is not None else None)
        full, data = StreamDigests(), StreamDigests()
        meta: dict[str, tuple[str, list[int], int, str]] = {}
        try:
            for i, name in plan:
                try:
                    t = handles[i].get_tensor(name)
                except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad data
                    raise RefitConfigError(f"{files[i]}: tensor {name!r} cannot be read: {e}") from None
                full.add(name, t)
                data.add(name, logical_bytes(t))
                nbytes = t.numel() * t.element_size()
                meta[name] = (dtype_name(t.dtype), list(t.shape), nbytes, rel[i])
                del t
                if tick is not None:
                    tick(nbytes)
            fd, dd = full.digests(), data.digests()
        finally:
            if bar is not None:
                bar.close()
    finally:
        for h in handles:
            _close(h)
    tensors = {n: TensorRecord(fd[n], dd[n], dt, shape, nb, fl) for n, (dt, shape, nb, fl) in meta.items()}
    return CheckpointManifest(DIGEST_SPEC_VERSION, str(src), rel, tensors, f"refit-verify {__version__}")


_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8, "C128": 16}


def _slice_bytes(sl: Any) -> int:
    """Bytes of a tensor from its header (for the progress total; 0 for a dtype not listed here)."""
    return math.prod(sl.get_shape()) * _ST_ITEMSIZE.get(sl.get_dtype(), 0)


def _close(h: Any) -> None:
    exit_ = getattr(h, "__exit__", None)
    if exit_ is not None:
        exit_(None, None, None)


# ------------------------------------------------------------------------------ any manifest, compared


@dataclass
class LoadedManifest:
    """A manifest read by :func:`load_manifest`, of any kind.

    Attributes:
        kind: ``"checkpoint"``, ``"session"`` (a worker's SessionManifest) or ``"digests"`` (a
            plain ``{name: 32-hex}`` object).
        label: what it is, for people (``"checkpoint /ckpt (3 files)"``, ``"session s1 version 4
            from worker rank 0 (...)"``).
        digests: ``{name: 32-hex}``; a session's non-model modules as ``"drafter:name"``.
        tensors: the checkpoint's records (dtype, shape, bytes), None for the other kinds.
    """

    kind: str
    label: str
    digests: dict[str, str]
    tensors: dict[str, TensorRecord] | None = None


def load_manifest(path: str | Path) -> LoadedManifest:
    """Read a manifest file of any supported kind, validating it.

    Supported: a :class:`CheckpointManifest` (``"type": "checkpoint_manifest"``), a
    :class:`~refit_verify.manifest.SessionManifest` as ``to_wire`` gives it (``"type":
    "session_manifest"``), a JSON object mapping every name to a 32-hex digest.

    Raises:
        RefitConfigError: unreadable, not JSON, not an object, an unknown ``type``, a malformed
            record (the path of the bad field named), a value that is not a 32-hex digest.
    """
    raw = _read(path)
    src = str(path)
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise RefitConfigError(f"{src}: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RefitConfigError(f"{src}: expected a JSON object (a manifest), got a JSON {type(doc).__name__}")
    kind = doc.get("type")
    if kind == "checkpoint_manifest":
        m = decode_manifest(raw, src)
        return LoadedManifest("checkpoint", f"checkpoint {m.source} ({len(m.files)} file{'s' * (len(m.files) != 1)})", m.digests(), dict(m.tensors))
    if kind == "session_manifest":
        from refit_verify.errors import RefitProtocolError
        from refit_verify.manifest import SessionManifest, from_wire

        try:
            s = from_wire(doc, SessionManifest)
        except RefitProtocolError as e:
            raise RefitConfigError(f"{src}: {e}") from None
        digests: dict[str, str] = {}
        for module in sorted(s.modules, key=lambda m: (m != "model", m)):
            digests.update({(n if module == "model" else f"{module}:{n}"): d for n, d in s.modules[module].digests.items()})
        bad = [n for n, d in digests.items() if not _is_hex32(d)]
        if bad:
            raise RefitConfigError(f"{src}: session manifest digest of {bad[0]!r} is not 32 lowercase hex characters")
        version = f" version {s.version}" if s.version is not None else ""
        return LoadedManifest("session", f"session {s.session}{version} from {s.worker.label()}", digests)
    if "type" in doc and not _is_hex32(doc["type"]):
        raise RefitConfigError(f"{src}: unknown manifest type {doc['type']!r} (known: checkpoint_manifest, session_manifest, "
                               "or a plain {name: 32-hex} object)")
    for n, d in doc.items():
        if not _is_hex32(d):
            raise RefitConfigError(f"{src}: entry {n!r}: {d!r:.60} is not a 32-character lowercase hex digest "
                                   "(a plain manifest maps every name to one)")
    return LoadedManifest("digests", f"digests {src} ({len(doc)} names)", dict(doc))


def _is_hex32(v: object) -> bool:
    return isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v)


KINDS = ("bytes", "dtype", "shape", "dtype+shape", "only in A", "only in B")
"""The kinds of :class:`Difference`, in report order."""


@dataclass(frozen=True)
class Difference:
    """One name that differs between manifests A and B.

    Attributes:
        name: the tensor name.
        kind: ``"bytes"`` (digests differ, dtype and shape equal or unknown), ``"dtype"``,
            ``"shape"``, ``"dtype+shape"`` (the metadata differs), ``"only in A"``, ``"only in B"``.
        digest_a, digest_b: the digests (None on the side that lacks the name).
        detail: for metadata differences ``"bfloat16 -> float16"`` / ``"[4, 8] -> [8, 4]"``, with
            ``"same bytes"`` or ``"other bytes"`` when both data digests are known; for a name on
            one side only whose digest the other side holds under a name of its own,
            ``"renamed? B has the same tensor as NAME"``.
    """

    name: str
    kind: str
    digest_a: str | None
    digest_b: str | None
    detail: str = ""


@dataclass(frozen=True)
class ManifestDiff:
    """Result of :func:`compare`.

    Attributes:
        differences: every differing name once: A's order, then names only in B.
        equal: names with equal digests on both sides.
    """

    differences: tuple[Difference, ...]
    equal: int
    counts: Mapping[str, int] = field(default_factory=dict)
    """``{kind: number of differences}`` in :data:`KINDS` order, kinds that occur only."""

    @property
    def ok(self) -> bool:
        """True iff both manifests have the same names and equal digests."""
        return not self.differences


def compare(a: LoadedManifest, b: LoadedManifest) -> ManifestDiff:
    """Compare two manifests name by name.

    Returns:
        ManifestDiff: the differences (see :class:`Difference` for the kinds) and the count of
        equal names. dtype and shape are compared where both sides record them (checkpoints).
    """
    diffs: list[Difference] = []
    equal = 0
    ta, tb = a.tensors or {}, b.tensors or {}
    for name, da in a.digests.items():
        db = b.digests.get(name)
        if db is None:
            diffs.append(Difference(name, "only in A", da, None))
        elif da == db:
            equal += 1
        else:
            diffs.append(_changed(name, da, db, ta.get(name), tb.get(name)))
    only_a = {n: d for n, d in a.digests.items() if n not in b.digests}
    only_b = {n: d for n, d in b.digests.items() if n not in a.digests}
    by_a, by_b = _by_digest(only_a), _by_digest(only_b)
    diffs = [Difference(d.name, d.kind, d.digest_a, d.digest_b, _renamed("B", by_b.get(d.digest_a, ()))) if d.kind == "only in A" else d
             for d in diffs]
    diffs += [Difference(n, "only in B", None, d, _renamed("A", by_a.get(d, ()))) for n, d in only_b.items()]
    counts = {k: n for k in KINDS if (n := sum(d.kind == k for d in diffs))}
    return ManifestDiff(tuple(diffs), equal, counts)


def _by_digest(m: Mapping[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n, d in m.items():
        out.setdefault(d, []).append(n)
    return out


def _renamed(side: str, names: list[str] | tuple[()]) -> str:
    if not names:
        return ""
    more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
    return f"renamed? {side} has the same tensor as {names[0]}{more}"


def _changed(name: str, da: str, db: str, ra: TensorRecord | None, rb: TensorRecord | None) -> Difference:
    if ra is None or rb is None:
        return Difference(name, "bytes", da, db)
    parts, kinds = [], []
    if ra.dtype != rb.dtype:
        kinds.append("dtype")
        parts.append(f"{ra.dtype} -> {rb.dtype}")
    if ra.shape != rb.shape:
        kinds.append("shape")
        parts.append(f"{ra.shape} -> {rb.shape}")
    if not kinds:
        return Difference(name, "bytes", da, db, f"{ra.dtype} {ra.shape}, other bytes")
    parts.append("same bytes" if ra.data_digest == rb.data_digest else "other bytes")
    return Difference(name, "+".join(kinds), da, db, ", ".join(parts))
