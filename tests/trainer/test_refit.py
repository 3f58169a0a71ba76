"""Bad input gets refit-verify's own error; the trainer's verdicts that audits read; which engines
get their waits bounded from a helper thread. No vLLM needed."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import refit_verify
from refit_verify import verdicts
from refit_verify.trainer.channel import _in_other_process, channel
from refit_verify.errors import RefitConfigError, RefitInputError, RefitVerificationError
from refit_verify.compare import compare_manifests

HEX = "0" * 32


@pytest.mark.parametrize("value", [None, [1, 2], np.ones(3), "tensor"])
def test_add_of_something_that_is_not_a_tensor_is_refused(value):
    r = refit_verify.refit(None, mode="off")  # off: no engine needed, but the input is still checked
    r.mode = refit_verify.VerifyMode.LOG
    with pytest.raises(RefitInputError, match="only torch tensors can be digested"):
        r.add("x", value)
    assert r.expected() == {"model": {}}  # a refused add leaves nothing behind


def test_add_names_its_module():
    r = refit_verify.refit(None, mode="off")
    with pytest.raises(RefitConfigError, match="module must be one of 'model', 'drafter'"):
        r.add("x", torch.ones(2), module="bogus")


def test_tensors_that_cannot_be_digested_are_refused():
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(RefitInputError, match="quantized tensor"):
        refit_verify.tensor_digest(q)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(RefitInputError, match="nested tensor"):
        refit_verify.tensor_digest(nested)
    with pytest.raises(RefitInputError, match="at most 255 dimensions"):
        refit_verify.tensor_digest(torch.ones([1] * 256))
    z = torch._efficientzerotensor(4)  # a plain Tensor at address 0 whose storage claims 16 bytes (found in review:
    with pytest.raises(RefitInputError, match="ZeroTensor"):  # a garbage digest alone, a crash in a batch of 4)
        refit_verify.tensor_digest(z)
    with pytest.raises(RefitInputError, match="ZeroTensor"):
        refit_verify.digest_tensors({"z": z, **{f"w{i}": torch.ones(4) for i in range(4)}})


class _Str(str):
    pass


@pytest.mark.parametrize("bad", [None, {"a": "XYZ"}, {"a": "A" * 32}, {1: HEX}, {"a": None}, {"a": HEX, "b": HEX[:31]},
                                 {"a": HEX[:31], "b": HEX + "0"}, {"a": HEX, "b": " " + HEX[1:]}, {"a": HEX[:-1] + "\n"},
                                 {"a": HEX, "b": HEX[:16] + "G" + HEX[17:]}, {"a": HEX, "b": b"0" * 32}, {"a": HEX, "b": _Str("z" * 32)}])
def test_bad_manifests_are_refused(bad):
    """Every entry is a str name and 32 lowercase hex characters (values that only add up to 32 per
    entry together, or a str subclass holding other characters, are refused too), naming the entry."""
    with pytest.raises(RefitInputError, match="manifest"):
        compare_manifests(bad, {"a": HEX})
    with pytest.raises(RefitInputError, match="manifest"):
        compare_manifests({"a": HEX}, bad)


def test_a_mapping_is_compared_as_it_was_checked():
    """A Mapping whose views disagree (values() valid, items() / [] not) is refused or compared by
    the pairs that were checked: never a pass over values nobody checked (found in review)."""
    from collections.abc import Mapping

    class Lying(Mapping):
        def __init__(self, good, served):
            self.good, self.served = good, served

        def __getitem__(self, k):
            return self.served[k]

        def __iter__(self):
            return iter(self.good)

        def __len__(self):
            return len(self.good)

        def values(self):
            return list(self.good.values())

    class Anything:
        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

    other = "1" * 32
    with pytest.raises(RefitInputError, match="receiver manifest entry 'w'"):
        compare_manifests({"w": HEX}, Lying({"w": other}, {"w": Anything()}))
    rep = compare_manifests({"w": HEX}, Lying({"w": other}, {"w": other}))
    assert not rep.ok and rep.mismatched == ("w",)
    # a plain dict equal to the sender's only through a value's (or a key's) own __eq__ is checked, not taken as equal
    with pytest.raises(RefitInputError, match="receiver manifest entry 'w'"):
        compare_manifests({"w": HEX}, {"w": Anything()})

    class Key:
        def __hash__(self):
            return hash("w")

        def __eq__(self, other):
            return other == "w"

    with pytest.raises(RefitInputError, match="receiver manifest entry"):
        compare_manifests({"w": HEX}, {Key(): HEX})


def test_good_manifests_pass_with_str_subclasses():
    ok = {"a": HEX, _Str("b"): _Str(HEX), "": "0" * 32}
    assert compare_manifests(ok, dict(ok)).ok
    empty = compare_manifests({}, {})  # equal, but nothing was compared: never a pass (issue #50)
    assert not empty.ok and empty.nothing_checked and empty.describe().endswith("(0 of 0 verified): nothing was checked: the "
                                                                             "trainer stated no tensor and the worker loaded none "
                                                                             "(a refit that compares nothing verifies nothing)")


def test_allow_as_one_string_is_refused():
    with pytest.raises(RefitConfigError, match="not one string"):
        refit_verify.refit(None, mode="off", allow="*.lora_*")


def test_verdicts_record_failures_and_a_pass_clears_them():
    verdicts.record("s-test-1", False, "its refit failed verification")
    assert verdicts.failed("s-test-1") == "its refit failed verification"
    verdicts.record("s-test-1", True)
    assert verdicts.failed("s-test-1") is None and verdicts.failed(None) is None
    for i in range(verdicts.MAX_KEPT + 5):
        verdicts.record(f"s-many-{i}", False)
    assert verdicts.failed("s-many-0") is None and verdicts.failed(f"s-many-{verdicts.MAX_KEPT + 4}") is not None


class SyncMPClient:
    pass


class InprocClient:
    pass


class _Engine:
    def __init__(self, core):
        self.engine_core = core


class _LLM:
    def __init__(self, core):
        self.llm_engine = _Engine(core)


def test_waits_into_another_process_are_bounded_from_a_thread_in_process_ones_are_not():
    assert _in_other_process(_LLM(SyncMPClient())) and not _in_other_process(_LLM(InprocClient()))
    assert _in_other_process(_Engine(SyncMPClient())) and not _in_other_process(_Engine(InprocClient()))
    assert _in_other_process(SyncMPClient()) and not _in_other_process(InprocClient())
    assert not _in_other_process(object())


@pytest.mark.parametrize("bad", ["quantized", "nested", "meta", "freed", "zero tensor", "not a tensor"])
def test_held_adds_refuse_what_cannot_be_digested(bad):
    """refit(copy=False) refuses at its add a tensor that has no bytes to read, a quantized or a
    nested one (the other checks wait for the launch: tests/digest/test_incremental.py): a refused add
    raises RefitInputError and leaves nothing behind."""
    r = refit_verify.refit(None, mode="off", copy=False)
    r.mode = refit_verify.VerifyMode.LOG
    good = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    r.add("good", good)
    if bad == "quantized":
        t = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    elif bad == "nested":
        t = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    elif bad == "meta":
        t = torch.nn.Parameter(torch.empty(3, device="meta"), requires_grad=False)
    elif bad == "freed":
        t = torch.nn.Parameter(torch.ones(8), requires_grad=False)
        t.untyped_storage().resize_(0)
    elif bad == "zero tensor":
        t = torch._efficientzerotensor(4)
    else:
        t = [1.0, 2.0]
    with pytest.raises(RefitInputError):
        r.add("bad", t)
    assert r.expected() == {"model": {"good": refit_verify.tensor_digest(good)}}


def test_a_sender_value_equal_to_anything_does_not_take_the_equal_receiver_shortcut():
    """A sender value of a ``str`` subclass whose ``__eq__`` says yes to any string (it holds 32 hex
    characters, so it passes the sender's check) must not make a receiver holding other bytes equal:
    the comparison names the entry mismatched (found in review)."""

    class LaxHex(str):
        def __eq__(self, other):
            return isinstance(other, str)

        __hash__ = str.__hash__

    rep = compare_manifests({"w": LaxHex("a" * 32)}, {"w": "b" * 32})
    assert not rep.ok and rep.mismatched == ("w",)


def test_a_channel_passes_timeout_only_to_a_collective_rpc_that_takes_it_every_time():
    """Whether an engine's collective_rpc takes ``timeout`` is read once per function (a signature is
    about 45 µs of every refit() otherwise): engines of one class, later ones included, get it; a
    class whose collective_rpc does not take it never does."""
    seen = []

    class WithTimeout:
        def collective_rpc(self, method, args=(), timeout=None):
            seen.append(("with", method, timeout))
            return [method]

    class Without:
        def collective_rpc(self, method, args=()):
            seen.append(("without", method))
            return [method]

    for _ in range(2):
        for engine in (WithTimeout(), Without()):
            assert channel(engine).call("m", timeout_s=7.0) == ["m"]
    assert seen == [("with", "m", 7.0), ("without", "m")] * 2


@pytest.mark.parametrize("module", [["model"], {}, None, b"model", "drafters"])
def test_an_add_to_a_module_that_is_not_one_is_a_config_error_before_and_after_a_good_add(module):
    r = refit_verify.refit(None, mode="off", copy=False)
    r.mode = refit_verify.VerifyMode.LOG
    for _ in range(2):
        with pytest.raises(RefitConfigError, match="module must be one of"):
            r.add("w", torch.ones(2), module)
        r.add("w", torch.ones(2))


def test_a_channel_keeps_no_engine_alive_through_its_collective_rpc():
    """Only a method's class function is remembered (whether it takes ``timeout``): a closure, a
    partial or a callable object handed as collective_rpc, which may hold its engine, is not."""
    import functools
    import gc
    import weakref

    class Engine:
        def rpc(self, method, args=(), timeout=None):
            return [timeout]

    class Holder:
        pass

    refs = []
    for make in (lambda e: (lambda method, args=(), timeout=None: e.rpc(method, args, timeout)),
                 lambda e: functools.partial(Engine.rpc, e)):
        e = Engine()
        h = Holder()
        h.collective_rpc = make(e)
        assert channel(h).call("m", timeout_s=3.0) == [3.0]
        refs.append(weakref.ref(e))
        del e, h
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_verdicts_remember_passes_too():
    verdicts.record("s-pass-1", True)
    assert verdicts.passed("s-pass-1") and verdicts.failed("s-pass-1") is None
    verdicts.record("s-pass-1", False, "it failed later")
    assert not verdicts.passed("s-pass-1") and verdicts.failed("s-pass-1") == "it failed later"
    assert not verdicts.passed("s-never-seen") and not verdicts.passed(None)


# -- nothing checked is never a pass: engines that cannot be checked (issue #50) -------------------------


@pytest.fixture
def toy(monkeypatch):
    """A toy worker reached through a fake engine running the plugin's session methods."""
    from refit_verify.vllm_plugin import worker_sessions
    from tests.support.toy_model import ToyEngine, toy_worker

    monkeypatch.setattr(worker_sessions, "attach_models", lambda *a, **k: None)  # the toy model is attached already
    worker, wb, model = toy_worker()
    return ToyEngine(worker), wb, model


def _refit(engine, mode, weights, load=None, **kw):
    with refit_verify.refit(engine, mode=mode, **kw) as r:
        for n, t in weights.items():
            r.add(n, t)
        if load is not None:
            load(list(weights.items()))
    return r


def _held_from_failed(session: str, labels: str) -> tuple[str]:
    """The problem of a partial refit that leaves one parameter (``labels``) as failed ``session`` wrote it."""
    return (f"1 parameters this refit did not write (or wrote in part) hold what session {session!r} wrote, which its refit "
            f"failed verification in this trainer ({labels}): push them again, or refit in full",)


NOT_INSTALLED = AttributeError("'CPUWorker' object has no attribute 'refit_verify_session_open'")
NOT_VERIFYING = [{"rank": 0, "verifying": False, "reason": "REFIT_VERIFY=off in this vLLM worker"}]


@pytest.mark.parametrize("answer, says", [([], "refit_verify_session_open through ToyEngine answered for no worker"),
                                          (NOT_INSTALLED, "is refit-verify installed in the vLLM engine's environment?"),
                                          (NOT_VERIFYING, "vLLM worker rank 0 does not verify (REFIT_VERIFY=off in this")])
def test_an_engine_that_cannot_be_checked_fails_in_enforce_and_warns_in_log(toy, caplog, answer, says):
    from tests.support.toy_model import ToyEngine, toy_weights

    engine, wb, model = toy
    engine = ToyEngine(*engine.workers, answer={"refit_verify_session_open": answer})
    w = toy_weights(1)
    with pytest.raises(RefitConfigError, match=re.escape(says)):
        _refit(engine, "enforce", w, model.load_weights)
    with caplog.at_level("WARNING", logger="refit_verify"):
        r = _refit(engine, "log", w, model.load_weights)
    assert says in caplog.text
    (rep,) = r.reports  # an unverified refit in log: one failing report saying why, never an empty (all-pass) list
    assert not rep.ok and rep.nothing_checked and says in rep.describe() and rep.session == r.session
    assert verdicts.failed(r.session) == "its workers could not be checked"
    assert wb.open_session is None  # every worker that did open was closed


def test_a_close_answered_for_no_worker_is_not_a_pass(toy):
    from tests.support.toy_model import ToyEngine, toy_weights

    engine, wb, model = toy
    engine = ToyEngine(*engine.workers, answer={"refit_verify_session_close": []})
    r = refit_verify.refit(engine, mode="enforce")
    with pytest.raises(RefitConfigError, match="refit_verify_session_close through ToyEngine answered for no worker"):
        with r:
            for n, t in toy_weights(1).items():
                r.add(n, t)
    assert r.reports == [] and verdicts.failed(r.session) == "its verification did not complete (RefitConfigError)"


def test_a_close_that_says_the_worker_does_not_verify_names_it(toy):
    from tests.support.toy_model import ToyEngine

    engine, wb, model = toy
    engine = ToyEngine(*engine.workers, answer={"refit_verify_session_close": NOT_VERIFYING})
    with pytest.raises(refit_verify.RefitProtocolError, match=re.escape("worker rank 0 does not verify (REFIT_VERIFY=off in")):
        _refit(engine, "enforce", {"embed": torch.ones(2)})


def test_refits_that_compare_no_tensor_fail_and_an_empty_partial_one_passes_on_what_was_verified(toy):
    from tests.support.toy_model import toy_weights

    engine, wb, model = toy
    nothing = "nothing was checked: the trainer stated no tensor and the worker loaded none"
    with pytest.raises(refit_verify.RefitVerificationError, match=nothing):
        _refit(engine, "enforce", {}, version=1, partial=True)  # the first refit: nothing earlier to compare with
    w = toy_weights(1)
    # nothing pushed: each announced tensor is judged by what the engine holds where its layout map puts it
    with pytest.raises(refit_verify.RefitVerificationError, match="judged by the engine state"):
        _refit(engine, "enforce", w, version=2)
    clean = _refit(engine, "enforce", w, model.load_weights, version=3)
    assert clean.reports[0].ok and clean.reports[0].verified == 5
    r = _refit(engine, "enforce", {}, version=4, partial=True)  # deliberately empty: the engine holds what version 3 left
    (rep,) = r.reports
    assert rep.ok and rep.unchanged == 3 and rep.verified == 0 and "an empty partial refit" in rep.unchecked[0]
    assert wb.manifests[r.session].unchanged_since == clean.session
    assert wb.manifests[r.session].unchanged_by == {clean.session: ["qkv_proj", "embed", "norm"]}
    with pytest.raises(refit_verify.RefitVerificationError, match=nothing):
        _refit(engine, "enforce", {}, version=5)  # full: every parameter unwritten
    # it failed having written nothing: the engine still holds what version 3 wrote and verified
    r = _refit(engine, "enforce", {}, version=6, partial=True)
    assert r.reports[0].ok and list(wb.manifests[r.session].unchanged_by) == [clean.session]
    assert _refit(engine, "enforce", w, model.load_weights, version=7).reports[0].ok
    with torch.no_grad():  # changed outside any load
        model.embed[0, 0] += 1
    with pytest.raises(refit_verify.RefitVerificationError, match="1 changed: embed"):
        _refit(engine, "enforce", {}, version=8, partial=True)


def test_what_a_partial_refit_leaves_is_vouched_for_only_as_far_as_the_writes_that_put_it_there(toy, monkeypatch):
    """A partial refit passes for the parameters it did not write (or wrote in part) only if this
    trainer verified the writes that put their bytes there: its worker's close names them by the
    sessions that wrote them (``unchanged_by``) and those whose bytes changed outside any refit
    (``tainted``). A failed session vouches for what it wrote right; a trainer that did not see a
    session (restarted) does not vouch for it."""
    from refit_verify import verdicts
    from tests.support.toy_model import toy_weights

    engine, wb, model = toy
    w = toy_weights(1)
    assert _refit(engine, "enforce", w, model.load_weights, version=1).reports[0].ok
    w2 = toy_weights(2)
    with pytest.raises(refit_verify.RefitVerificationError, match="mismatched"):  # loads other bytes than it states
        _refit(engine, "enforce", w2, lambda items: model.load_weights(list({**w2, "embed": w2["embed"] + 1}.items())), version=2)
    bad = wb.last.session
    with pytest.raises(refit_verify.RefitVerificationError) as ei:
        _refit(engine, "enforce", {}, version=3, partial=True)
    assert ei.value.report.problems == (f"this partial refit wrote nothing, and 1 parameters it found hold what session {bad!r} "
                                        "wrote, which its refit failed verification in this trainer (embed): push them again, "
                                        "or refit in full",)
    # the one it wrote wrong, written again: the others it wrote verified
    assert _refit(engine, "enforce", {"embed": w2["embed"]}, model.load_weights, version=4, partial=True).reports[0].ok

    # a fused parameter written in part over a failed write of another of its parts
    with pytest.raises(refit_verify.RefitVerificationError, match="mismatched"):
        _refit(engine, "enforce", {"k_proj": w["k_proj"]}, lambda items: model.load_weights([("k_proj", w["k_proj"] + 1)]),
               version=5, partial=True)
    bad_k = wb.last.session
    with pytest.raises(refit_verify.RefitVerificationError) as ei:
        _refit(engine, "enforce", {"q_proj": w["q_proj"]}, model.load_weights, version=6, partial=True)
    assert ei.value.report.problems == _held_from_failed(bad_k, "qkv_proj")
    qkv = {n: w[n] for n in ("q_proj", "k_proj", "v_proj")}
    assert _refit(engine, "enforce", qkv, model.load_weights, version=7, partial=True).reports[0].ok

    with torch.no_grad():  # changed outside any refit: named by the next close, and by every one until written again
        model.norm[0] += 1
    with pytest.raises(refit_verify.RefitVerificationError, match="1 changed: norm"):
        _refit(engine, "enforce", {"embed": w["embed"]}, model.load_weights, version=8, partial=True)
    found = wb.last.session
    with pytest.raises(refit_verify.RefitVerificationError) as ei:
        _refit(engine, "enforce", {"embed": w["embed"]}, model.load_weights, version=9, partial=True)
    assert ei.value.report.problems == (f"1 parameters this refit did not write (or wrote in part) hold bytes changed outside "
                                        f"any refit (found at the close of session {found!r}), and no refit has written them "
                                        "whole since (norm)",)
    (c,) = refit_verify.certificate(engine)
    assert not c.ok
    assert _refit(engine, "enforce", {"norm": w["norm"]}, model.load_weights, version=10, partial=True).reports[0].ok
    (c,) = refit_verify.certificate(engine)
    assert c.ok

    for table in ("_PASSED", "_FAILED", "_BAD"):  # a restarted trainer process: it saw none of the sessions that wrote the state
        monkeypatch.setattr(verdicts, table, {})
    with pytest.raises(refit_verify.RefitVerificationError, match="which this trainer process did not verify"):
        _refit(engine, "enforce", {"norm": w["norm"]}, model.load_weights, version=11, partial=True)
    assert _refit(engine, "enforce", w, model.load_weights, version=12).reports[0].ok  # a full refit: vouched for again
    assert _refit(engine, "enforce", {"norm": w["norm"]}, model.load_weights, version=13, partial=True).reports[0].ok


def test_a_partial_refit_vouches_neither_for_the_start_weights_nor_for_an_allowed_part_write(toy):
    """Parameters no refit wrote hold what the engine was started with: a partial refit leaving them
    fails until a full refit (or ``verify_state``) covers them. ``allow`` on a fused parameter does not
    make writing one part of it a whole write. Parts written again by later sessions drop the earlier
    writers they cover, together."""
    from tests.support.toy_model import toy_weights

    engine, wb, model = toy
    w = toy_weights(1)
    with pytest.raises(refit_verify.RefitVerificationError) as ei:  # the first refit, partial: the rest is the start's
        _refit(engine, "enforce", {"norm": w["norm"]}, model.load_weights, version=1, partial=True)
    (p,) = ei.value.report.problems
    assert p.startswith("2 parameters this refit did not write (or wrote in part) hold what the engine was started with")
    assert "(qkv_proj, embed)" in p
    assert _refit(engine, "enforce", w, model.load_weights, version=2).reports[0].ok
    assert _refit(engine, "enforce", {"norm": w["norm"]}, model.load_weights, version=3, partial=True).reports[0].ok

    with pytest.raises(refit_verify.RefitVerificationError, match="mismatched"):  # k written wrong
        _refit(engine, "enforce", w, lambda items: model.load_weights(list({**w, "k_proj": w["k_proj"] + 1}.items())), version=4)
    with pytest.raises(refit_verify.RefitVerificationError, match="qkv_proj"):  # q only, qkv_proj exempt: still in part
        _refit(engine, "enforce", {"q_proj": w["q_proj"]}, model.load_weights, version=5, partial=True, allow=["qkv_proj"])
    with pytest.raises(refit_verify.RefitVerificationError, match="qkv_proj"):  # v: still the failed session's
        _refit(engine, "enforce", {"k_proj": w["k_proj"]}, model.load_weights, version=6, partial=True)
    # v written again too: the failed session's regions are all covered by later writes (q, k, v: three sessions)
    assert _refit(engine, "enforce", {"v_proj": w["v_proj"]}, model.load_weights, version=7, partial=True).reports[0].ok
    assert _refit(engine, "enforce", {"q_proj": w["q_proj"]}, model.load_weights, version=8, partial=True).reports[0].ok
    assert len(wb._basis["qkv_proj"]) == 3  # k, v and the last q: the earlier q's writer dropped


def test_a_partial_refit_compares_the_parts_it_leaves_of_a_parameter_it_writes_in_part(toy):
    """A parameter written in part (one projection of a fused qkv): its other regions, where the
    layout map has them and the last close read them, are compared with what that close read. A
    change there outside any refit fails the refit, and every later one until the parameter is
    written whole; unchanged, nothing is left unchecked, across refits that change the part they
    write."""
    from tests.support.toy_model import KV, toy_weights

    engine, wb, model = toy
    w = toy_weights(1)
    assert _refit(engine, "enforce", w, model.load_weights, version=1).reports[0].ok
    for version, seed in ((2, 2), (3, 3)):  # k changes each step; q and v stay as version 1 left them
        k = {"k_proj": toy_weights(seed)["k_proj"]}
        (rep,) = _refit(engine, "enforce", k, model.load_weights, version=version, partial=True).reports
        assert rep.ok and rep.unchecked == ()
    with torch.no_grad():  # the v rows changed outside any refit
        model.qkv_proj[-KV, 0] += 1
    with pytest.raises(refit_verify.RefitVerificationError) as ei:
        _refit(engine, "enforce", {"k_proj": w["k_proj"]}, model.load_weights, version=4, partial=True)
    found = wb.last.session
    (p,) = ei.value.report.problems
    assert "qkv_proj: rows " in p and "changed since the last close, and this refit did not write them" in p
    assert "1 changed: qkv_proj" in p
    assert not refit_verify.certificate(engine)[0].ok
    with pytest.raises(refit_verify.RefitVerificationError) as ei:  # and until written whole
        _refit(engine, "enforce", {"v_proj": w["v_proj"]}, model.load_weights, version=5, partial=True)
    assert ei.value.report.problems == (f"1 parameters this refit did not write (or wrote in part) hold bytes changed outside "
                                        f"any refit (found at the close of session {found!r}), and no refit has written them "
                                        "whole since (qkv_proj)",)
    qkv = {n: w[n] for n in ("q_proj", "k_proj", "v_proj")}
    assert _refit(engine, "enforce", qkv, model.load_weights, version=6, partial=True).reports[0].ok
    assert _refit(engine, "enforce", {"k_proj": w["k_proj"]}, model.load_weights, version=7, partial=True).reports[0].ok
    assert refit_verify.certificate(engine)[0].ok


def test_a_full_refit_whose_allow_exempts_a_part_of_a_fused_parameter_compares_the_rest(toy):
    """A full refit that writes q of qkv_proj and exempts the rest through ``allow``: k and v are
    compared with what the last close read there, as for a partial refit; unchanged, the refit
    passes."""
    from tests.support.toy_model import KV, toy_weights

    engine, wb, model = toy
    w = toy_weights(1)
    assert _refit(engine, "enforce", w, model.load_weights, version=1).reports[0].ok
    some = {n: w[n] for n in ("q_proj", "embed", "norm")}
    assert _refit(engine, "enforce", some, model.load_weights, version=2, allow=["qkv_proj"]).reports[0].ok
    with torch.no_grad():
        model.qkv_proj[-KV, 0] += 1
    with pytest.raises(refit_verify.RefitVerificationError, match="1 changed: qkv_proj"):
        _refit(engine, "enforce", some, model.load_weights, version=3, allow=["qkv_proj"])
    with pytest.raises(refit_verify.RefitVerificationError, match=r"hold bytes changed outside any refit .* \(qkv_proj\)"):
        _refit(engine, "enforce", {"q_proj": w["q_proj"]}, model.load_weights, version=4, partial=True)
    assert not refit_verify.certificate(engine)[0].ok


def test_a_delta_after_a_partial_refit_of_part_of_a_fused_parameter_passes(toy):
    """A delta on a partial refit that wrote q and v of the fused qkv: its k rows were read by that
    partial refit's close, so the delta proves them unchanged, and the next delta too."""
    from tests.support.toy_model import toy_weights

    engine, wb, model = toy
    w = dict(toy_weights(1))
    assert _refit(engine, "enforce", w, model.load_weights, version=1).reports[0].ok
    for version, kw in ((2, {"partial": True}), (3, {"base": 2}), (4, {"base": 3})):
        w["q_proj"], w["v_proj"] = w["q_proj"] + 1, w["v_proj"] + 1
        (rep,) = _refit(engine, "enforce", {n: w[n] for n in ("q_proj", "v_proj")}, model.load_weights, version=version,
                        **kw).reports
        assert rep.ok and rep.unchecked == (), (version, rep.unchecked)
    assert torch.equal(model.qkv_proj.data, torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]))


def test_a_failed_check_of_the_state_names_what_it_found_wrong(toy):
    """``verify_state`` that finds one projection wrong records the parameter holding it as written
    wrong, not every parameter it judged: a partial refit leaving it fails naming it alone, and one
    that writes it again passes."""
    from tests.support.toy_model import KV, toy_weights

    engine, wb, model = toy
    w, w2 = toy_weights(1), toy_weights(2)
    assert _refit(engine, "enforce", w, model.load_weights, version=1).reports[0].ok
    with torch.no_grad():
        model.qkv_proj[-KV, 0] += 1
    with pytest.raises(refit_verify.RefitVerificationError, match="1 mismatched: v_proj"):
        refit_verify.verify_state(engine, w, version=2, mode="enforce")
    checked = wb.last.session
    with pytest.raises(refit_verify.RefitVerificationError) as ei:
        _refit(engine, "enforce", {"norm": w2["norm"]}, model.load_weights, version=3, partial=True)
    assert ei.value.report.problems == _held_from_failed(checked, "qkv_proj")
    qkv = {n: w2[n] for n in ("q_proj", "k_proj", "v_proj")}
    assert _refit(engine, "enforce", qkv, model.load_weights, version=4, partial=True).reports[0].ok


def test_a_session_id_names_one_refit(toy):
    """A refit that reuses the session id of an earlier one is refused before it opens: verdicts are
    kept by id, and a pass under the id of a failed refit would replace its failure (a partial
    retry would then vouch for the bytes the failed one wrote wrong). The workers refuse an id of
    a session closed on them too, whoever asks (a restarted trainer)."""
    from refit_verify import verdicts
    from refit_verify.errors import RefitProtocolError
    from tests.support.toy_model import ToyEngine, toy_weights, toy_worker

    engine, wb, model = toy
    w, w2 = toy_weights(1), toy_weights(2)
    assert _refit(engine, "enforce", w, model.load_weights, version=1).reports[0].ok
    with pytest.raises(refit_verify.RefitVerificationError, match="mismatched"):
        _refit(engine, "enforce", w2, lambda items: model.load_weights(list({**w2, "embed": w2["embed"] + 1}.items())),
               version=2, session_id="step-2")
    for mode in ("enforce", "log"):
        with pytest.raises(RefitConfigError, match="session id 'step-2' was already used by a refit in this trainer process"):
            _refit(engine, mode, {"norm": w2["norm"]}, model.load_weights, version=2, partial=True, session_id="step-2")
    assert wb.open_session is None and verdicts.failed("step-2") == "its refit failed verification"
    with pytest.raises(refit_verify.RefitVerificationError, match=r"which its refit failed verification in this trainer \(embed\)"):
        _refit(engine, "enforce", {"norm": w2["norm"]}, model.load_weights, version=3, partial=True)
    # two replicas, one id: the second refit() is refused (its pass would replace the first one's verdict)
    worker_b, _wb_b, model_b = toy_worker()
    _refit(engine, "enforce", w, model.load_weights, version=4, session_id="dp-step-4")
    with pytest.raises(RefitConfigError, match="'dp-step-4' was already used"):
        _refit(ToyEngine(worker_b), "enforce", w, model_b.load_weights, version=4, session_id="dp-step-4")
    # the worker refuses an id closed on it (a trainer process that does not know it)
    with pytest.raises(RefitProtocolError, match="session id 'step-2' names a session already closed on this worker"):
        wb.open("step-2")
    assert wb.open_session is None


def test_a_channel_never_answers_with_no_worker():
    from refit_verify.trainer.channel import WorkerChannel

    class Empty:
        def collective_rpc(self, method, args=(), timeout=None):
            return []

    with pytest.raises(RefitConfigError, match=re.escape("m through Empty answered for no worker (an empty result list)")):
        channel(Empty()).call("m")
    two = WorkerChannel([lambda m, a, t: [1], lambda m, a, t: []], "two engines")
    with pytest.raises(RefitConfigError, match=re.escape("m through two engines, engine 2 of 2 answered for no worker")):
        two.call("m")


@pytest.mark.parametrize("mode", ["enforce", "off"])
def test_a_verifying_refit_starts_the_trainers_digest_warmup_and_an_off_one_does_not(monkeypatch, mode):
    from refit_verify.digest import backends

    class Engine:
        def collective_rpc(self, method, args=(), timeout=None):
            return []

    started = []
    monkeypatch.setattr(backends, "start_warmup", lambda device=None, then=None: started.append(device))
    refit_verify.refit(Engine(), mode=mode)
    refit_verify.refit(Engine(), mode=mode)
    assert started == ([None, None] if mode == "enforce" else [])  # None: this process's CUDA device if it uses one, else the CPU


def test_an_older_version_after_a_newer_one_fails_in_enforce_and_unversioned_refits_pass(toy):
    from tests.support.toy_model import toy_weights

    engine, wb, model = toy
    w = toy_weights(3)
    assert all(r.ok for r in _refit(engine, "enforce", w, model.load_weights, version=5).reports)
    with pytest.raises(RefitVerificationError) as ei:
        _refit(engine, "enforce", w, model.load_weights, version=3)
    rep = ei.value.report
    assert rep.version == 3 and rep.problems == (
        "stale refit: version 3 is older than version 5 already closed on this worker",)
    assert not refit_verify.certificate(engine)[0].ok  # the engine holds version 3 now, which failed
    assert all(r.ok for r in _refit(engine, "enforce", w, model.load_weights).reports)  # unversioned: no order
    assert all(r.ok for r in _refit(engine, "enforce", w, model.load_weights, version=6).reports)
    assert refit_verify.certificate(engine)[0].ok and refit_verify.certificate(engine)[0].version == 6


def test_a_refit_check_serves_one_session_adds_and_opens_after_it_are_refused(toy):
    """After its block (verified, or aborted by an exception) a RefitCheck takes no add and opens no
    second session: what it would take is checked by no session."""
    from tests.support.toy_model import toy_weights

    engine, wb, model = toy
    w = toy_weights(3)
    r = _refit(engine, "enforce", w, model.load_weights, version=1)
    assert all(x.ok for x in r.reports)
    with pytest.raises(RefitConfigError, match="already verified or aborted"):
        r.add("norm", w["norm"])
    with pytest.raises(RefitConfigError, match="a RefitCheck serves one session"):
        with r:
            pass
    assert r.verify() is r.reports and all(x.ok for x in r.reports)  # verify again: the same reports, no new close
    with pytest.raises(KeyError):
        with refit_verify.refit(engine, mode="enforce", version=2) as aborted:
            raise KeyError("the trainer's own error")
    with pytest.raises(RefitConfigError, match="already verified or aborted"):
        aborted.add("norm", w["norm"])
    assert all(x.ok for x in _refit(engine, "enforce", w, model.load_weights, version=2).reports)  # the engine is fine


@pytest.mark.parametrize("bad", [-1, 1.0, "3", True, 2**63, 2**64])
def test_a_version_that_is_not_an_int_from_0_is_refused(bad):
    with pytest.raises(RefitConfigError, match="version must be an int >= 0"):
        refit_verify.refit("http://127.0.0.1:1", version=bad, mode="off")
