"""A trainer that calls an in-process engine gets each worker's session manifest as the record
itself (no JSON both ways); every other caller, a forked child of the trainer included, gets text.
No vLLM needed: the plugin's close RPC is called on a worker-like object."""

from __future__ import annotations

import os
import types

import pytest
import torch

from refit_verify.trainer.channel import channel
from refit_verify.manifest import SessionManifest, from_wire, local_reply_token
from refit_verify.vllm_plugin import worker_sessions as sessions
from tests.support.toy_model import toy_worker


def _loader(param, loaded):
    param.data.copy_(loaded)


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        for p in self.parameters():
            p.weight_loader = _loader

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for n, t in weights:
            params[n].weight_loader(params[n], t)
        return {n for n, _ in weights}


def _worker():
    """A worker-like object holding a real WorkerBoundary around a toy model."""
    return toy_worker(_Toy(), _loader)


def _write(wb, model, sid, version):
    wb.open(sid, version=version)
    model.load_weights([("w", torch.full((4, 8), float(version))), ("b", torch.arange(8.0))])


def test_the_token_names_this_process_and_a_forked_child_has_another():
    tok = local_reply_token()
    assert tok == local_reply_token() and tok.endswith(f":{os.getpid()}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: same import of refit_verify, another pid
        os.close(r)
        os.write(w, local_reply_token().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 200).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert child != tok and child.split(":")[0] == tok.split(":")[0] and child.endswith(f":{pid}")


@pytest.mark.parametrize("reply_to", ["own", None, "other pid", "other process"])
def test_the_close_hands_its_record_over_only_to_a_caller_in_this_process(reply_to):
    worker, wb, model = _worker()
    _write(wb, model, "s1", 1)
    tok = local_reply_token()
    arg = {"own": tok, None: None, "other pid": f"{tok.split(':')[0]}:{os.getpid() + 1}",
           "other process": f"{'f' * 32}:{os.getpid()}"}[reply_to]
    out = sessions.refit_verify_session_close(worker, "s1", arg)
    assert out["rank"] == 0 and out["verifying"] is True
    if reply_to == "own":
        assert out["manifest"] is wb.last and isinstance(out["manifest"], SessionManifest)
    else:
        assert isinstance(out["manifest"], str)
    man = from_wire(out["manifest"])  # either form reads back to the same record
    assert man.session == "s1" and man.version == 1 and man.modules["model"].written == 2
    assert man.modules["model"].digests == wb.last.modules["model"].digests and len(man.modules["model"].digests) == 2


class _Core:
    pass


class InprocClient(_Core):
    pass


class SyncMPClient(_Core):
    pass


class _LLM:
    def __init__(self, core):
        self.llm_engine = types.SimpleNamespace(engine_core=core)
        self.calls = []

    def collective_rpc(self, method, args=(), timeout=None):
        self.calls.append((method, args))
        return [{"rank": 0, "args": list(args)}]


def test_only_a_direct_channel_into_an_in_process_engine_is_local():
    assert channel(_LLM(InprocClient())).local is True
    assert channel(_LLM(SyncMPClient())).local is False  # the engine core in another process: text

    class Forwarder:  # any other object with a collective_rpc: it may forward to an older refit-verify elsewhere
        def collective_rpc(self, method, args=(), timeout=None):
            return []

    assert channel(Forwarder()).local is False  # (found in review: it was taken for an in-process engine)
    assert channel("http://127.0.0.1:1").local is False

    class Handle:  # a Ray actor handle
        class collective_rpc:  # noqa: N801
            @staticmethod
            def remote(*a, **k):
                raise AssertionError("not called")

    assert channel(Handle()).local is False


def test_a_refit_on_an_in_process_engine_sends_the_token_with_the_close(monkeypatch):
    """The trainer API passes its token with the close only to an in-process engine's workers, whose
    close then answers with the record (the verdict is the same as from text)."""
    import refit_verify

    worker, wb, model = _worker()
    rpcs = {"refit_verify_session_open": sessions.refit_verify_session_open,
            "refit_verify_session_close": sessions.refit_verify_session_close}
    monkeypatch.setattr(sessions, "attach_models", lambda *a, **k: None)  # the toy model is attached already
    seen = []

    for core in (InprocClient(), SyncMPClient(), None):
        class Engine(_LLM):
            def collective_rpc(self, method, args=(), timeout=None):
                seen.append((type(core).__name__ if core is not None else "none", method, len(args) > 1 and args[1] is not None))
                return [rpcs[method](worker, *args)]

        eng = Engine(core)
        if core is None:  # an object that holds no engine core: no token
            del eng.llm_engine
        w = {"w": torch.full((4, 8), 3.0), "b": torch.arange(8.0) + 1}
        with refit_verify.refit(eng, version=len(seen) + 1, mode="enforce") as r:
            for n, t in w.items():
                r.add(n, t)
                model.load_weights([(n, t)])
        (rep,) = r.reports
        assert rep.ok and rep.verified == 2
        (man,) = r.manifests
        assert (man is wb.last) == isinstance(core, InprocClient)
    # (the close also carries the announced tensors: (session, token or None, announced))
    assert [(c, m, n) for c, m, n in seen if m.endswith("close")] == [("InprocClient", "refit_verify_session_close", True),
                                                                      ("SyncMPClient", "refit_verify_session_close", False),
                                                                      ("none", "refit_verify_session_close", False)]
