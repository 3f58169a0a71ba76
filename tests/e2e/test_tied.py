"""Tied embeddings in a real vLLM engine: the packaged tiny Llama with ``tie_word_embeddings: true``.

vLLM holds one tensor for ``model.embed_tokens.weight`` and ``lm_head.weight``. Exporters send
either name, or both. Through ``model.load_weights`` vLLM 0.32 loads the first name and skips the
other (and raises when only ``lm_head.weight`` comes); inside vLLM's layerwise reload each name is
written through its own copy of the parameter. Every combination must be judged by what the engine
then holds: either name alone or both equal verify, with every byte proven; both different fail,
naming both. The untied model is ``tests/e2e/test_boundary.py``'s.
"""

from __future__ import annotations

import gc
import itertools
import json

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.digest.batch import tensor_digest  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import engine_env, settle_device_memory  # noqa: E402
from tests.support.plugins import register_plain_linear  # noqa: E402

pytestmark = pytest.mark.vllm
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, L = "model.embed_tokens.weight", "lm_head.weight"
TIED_BYTES = 853248 - 512 * 128 * 2  # the tiny Llama's bf16 tensors, one embedding for both names
_VERSIONS = itertools.count(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama-tied")
    cfg = dict(models.load_config(models.packaged_config_dir()), tie_word_embeddings=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if DEVICE == "cpu":
        import numba  # noqa: F401  - as after earlier CPU digests: the plugin's cpu-kernel-scan patch must hold

        register_plain_linear()  # in-process engine: plugins of this process apply to it
    settle_device_memory()
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        from refit_verify.cli.demo import start_engine
        from refit_verify.vllm_plugin import register, shims

        register()
        llm = start_engine(d, DEVICE)
        worker = llm.llm_engine.model_executor.driver_worker.worker
        model = worker.get_model()
        params = dict(model.named_parameters(remove_duplicate=False))
        assert params[E] is params[L]  # tied in the engine
        yield llm, model, worker.model_runner.model_config, cfg, shims.layerwise_reload()
        del llm, worker, model, params
        gc.collect()


def _weights(cfg: dict, seed: int, sent: str) -> dict[str, torch.Tensor]:
    """The tied model's tensors with the embedding sent as ``sent`` says: ``"embedding"``, ``"lm_head"``
    (under ``lm_head.weight`` only), ``"equal"`` / ``"different"`` (both names)."""
    w = models.random_state_dict(cfg, seed=seed, device=DEVICE)
    if sent == "lm_head":
        w[L] = w.pop(E)
    elif sent == "equal":
        w[L] = w[E].clone()
    elif sent == "different":
        w[L] = (w[E].float() + 1).to(torch.bfloat16)
    return w


def _refit(engine, w: dict[str, torch.Tensor], layerwise: bool):
    """One refit through the trainer API: ``w`` in one ``load_weights`` list, inside vLLM's layerwise
    reload when ``layerwise``. Returns the worker's report."""
    llm, model, model_config, _cfg, (initialize, finalize) = engine
    with refit_verify.refit(llm, version=next(_VERSIONS)) as r:
        for name, t in w.items():
            r.add(name, t)
        if layerwise:
            initialize(model)
        model.load_weights(list(w.items()))
        if layerwise:
            finalize(model, model_config)
    (rep,) = r.reports
    return rep


def _held(engine) -> str:
    """The digest of the engine's one embedding tensor, read through the worker."""
    return engine[0].collective_rpc("refit_verify_param_digests", args=([E],))[0][E]


PATHS = pytest.mark.parametrize("layerwise", [False, True], ids=["load_weights", "layerwise reload"])


@pytest.mark.parametrize(("sent", "layerwise"), [("embedding", False), ("equal", False), ("embedding", True), ("lm_head", True),
                                                 ("equal", True)])
def test_tied_embedding_sent_as_the_engine_holds_it_verifies(engine, sent, layerwise):
    """Either name alone, or both with equal bytes: verified, every byte proven in the engine's
    layout, nothing unconsumed, unwritten or changed since the last session (was: lm_head alone
    "not written" + "changed since the last session"; both equal "consumed by no parameter").
    lm_head alone through ``load_weights``: :func:`test_lm_head_alone_through_load_weights_is_refused_by_vllm_and_never_verified`."""
    w = _weights(engine[3], 10 + len(sent) + layerwise, sent)
    rep = _refit(engine, w, layerwise)
    assert rep.ok and rep.verified == len(w) == (21 if sent == "equal" else 20)
    assert (rep.unconsumed, rep.unwritten, rep.problems, rep.receiver_error, dict(rep.not_proven)) == ((), (), (), None, {})
    assert (rep.proven_bytes, rep.unproven_bytes) == (TIED_BYTES, 0)
    assert _held(engine) == tensor_digest(w[E] if E in w else w[L])


@PATHS
def test_tied_embedding_sent_with_two_different_tensors_fails_naming_both(engine, layerwise):
    w = _weights(engine[3], 20 + layerwise, "different")
    with pytest.raises(RefitVerificationError) as ei:
        _refit(engine, w, layerwise)
    rep = ei.value.report
    e, h = tensor_digest(w[E]), tensor_digest(w[L])
    named = f"model: {E}, {L} are one tensor in the engine (tied), and this refit sent them with different bytes ({E} {e}, {L} {h})"
    assert rep.receiver_error.startswith(named)
    if layerwise:  # each name written through its own copy: the engine holds the later one, lm_head's
        assert rep.engine_mismatched == (E,) and rep.unconsumed == () and _held(engine) == h
    else:  # vLLM loaded the embedding and skipped lm_head.weight
        assert rep.unconsumed == (L,) and rep.engine_mismatched == () and _held(engine) == e
        assert rep.receiver_error.endswith(f"the model loaded {E} and skipped {L}: the engine holds {E} for all")


def test_lm_head_alone_through_load_weights_is_refused_by_vllm_and_never_verified(engine):
    """vLLM 0.32 skips the tied lm_head.weight and raises when the embedding is not in the call: the
    engine keeps its embedding, and the refit is aborted (its verdict a failure)."""
    before = _held(engine)
    w = _weights(engine[3], 30, "lm_head")
    with pytest.raises(ValueError, match="tied to 'model.embed_tokens.weight'"):
        _refit(engine, w, layerwise=False)
    assert _held(engine) == before != tensor_digest(w[L])
    rep = _refit(engine, _weights(engine[3], 31, "embedding"), layerwise=False)  # the next refit verifies again
    assert rep.ok and rep.problems == ()



def test_tied_embedding_pushed_with_two_different_tensors_fails_naming_both(engine):
    """Through the staged transport (``refit_verify.push``, vLLM's layerwise reload writes each name
    through its own copy) the same as through ``refit()``: both names with different bytes fail, the
    reason naming both (was: only ``engine_mismatched``, the session's tied error dropped on this path),
    and the engine holds the later one, lm_head's."""
    w = _weights(engine[3], 40, "different")
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.push(engine[0], w, version=next(_VERSIONS))
    rep = ei.value.report
    e, h = tensor_digest(w[E]), tensor_digest(w[L])
    named = f"model: {E}, {L} are one tensor in the engine (tied), and this refit sent them with different bytes ({E} {e}, {L} {h})"
    assert rep.receiver_error is not None and rep.receiver_error.startswith(named), rep.receiver_error
    assert rep.engine_mismatched == (E,) and rep.unconsumed == () and _held(engine) == h
    assert named in ei.value.report.describe()
    rep = refit_verify.push(engine[0], _weights(engine[3], 41, "equal"), version=next(_VERSIONS)).report  # then equal: verified
    assert rep.ok and rep.receiver_error is None and (rep.proven_bytes, rep.unproven_bytes) == (TIED_BYTES, 0)
