"""Methods added to vLLM's ``WorkerBase`` by :func:`refit_verify.vllm_plugin.register`.

Each runs inside a vLLM worker, reached through ``LLM.collective_rpc(name, args=...)``. Arguments and
return values are plain strings, numbers, lists and dicts (msgpack-safe), never tensors.
The ``refit_verify_`` prefix keeps them clear of every method vLLM's workers define.
"""

from __future__ import annotations

from typing import Any

METHODS = ("refit_verify_receive", "refit_verify_param_digests")


def refit_verify_receive(self, endpoint: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Receive one refit over the refit-verify transport and load it with ``model.load_weights``.

    Args:
        endpoint: the sender's ZMQ endpoint; ``{rank}`` is replaced by this worker's rank.
        options: keyword options of :class:`refit_verify.RefitConfig` (``mode`` is taken from the
            sender's handshake; timeouts and buffer sizes from here).

    Returns:
        dict: ``rank``, ``manifest`` (``{wire name: 32-hex}`` or None when not verifying),
        ``tensors``, ``bytes``, ``digest_s`` (receiver digest seconds), ``mode`` (agreed at the
        handshake), ``rejected`` (``{name: reason}`` of refused entries), ``error`` (or None).

    Raises:
        RefitConfigError: ``options`` is not a mapping or holds an unknown key, ``None``, an empty or
            out-of-range value (validated here, in the worker process).
        RefitTimeoutError: the sender went silent for longer than ``timeout_s`` or disconnected.
        RefitAbortedError: the sender aborted the refit.
        RefitProtocolError: the sender broke the protocol.

    On failure the layerwise reload is still finalized (the engine stays usable for the next refit);
    an error while finalizing is logged and the original error raised.
    """
    import logging

    from refit_verify.config import RefitConfig
    from refit_verify.transport import RefitReceiver

    cfg = RefitConfig.from_options(options, source="refit_verify_receive options")
    model = self.get_model()
    start, finish = _layerwise_reload()
    receiver = RefitReceiver(endpoint.format(rank=self.rank), config=cfg, device=self.device)

    def load(batch):
        # Layerwise reload defers a layer's processing until all its weights arrived and keeps
        # references to what it was handed: give it owned copies, never views of a staging slot
        # that the sender refills after our Ack (the staged-slot reuse race).
        model.load_weights([(n, t.clone()) for n, t in batch] if start else batch)

    if start:
        start(model)
    failed = True
    try:
        res = receiver.receive(load=load)
        failed = False
    finally:
        receiver.close()
        if finish:
            try:
                finish(model, self.model_config)
            except Exception:
                if not failed:
                    raise
                logging.getLogger("refit_verify").exception("finalizing the layerwise reload after a failed refit failed")
    return {"rank": self.rank, "manifest": res.manifest, "tensors": res.tensors, "bytes": res.bytes, "digest_s": res.digest_s,
            "mode": res.mode.value, "rejected": res.rejected, "error": res.error}


def refit_verify_param_digests(self, names: list[str] | None = None) -> dict[str, str]:
    """Return ``{vLLM parameter name: 32-hex digest}`` of the engine's current parameters.

    Reads back what the engine holds after loading (fused and sharded as vLLM stores them), for
    checks beyond the transport boundary.

    Args:
        names: parameter names as in ``model.named_parameters()``; None means all.

    Raises:
        KeyError: a requested name is not a parameter of the model.
    """
    from refit_verify.digest import digest_tensors

    params = dict(self.get_model().named_parameters())
    wanted = list(params) if names is None else list(names)
    missing = [n for n in wanted if n not in params]
    if missing:
        raise KeyError(f"not parameters of the model: {missing}")
    return digest_tensors((n, params[n].detach()) for n in wanted)


def _layerwise_reload():
    """Return vLLM's (initialize, finalize) layerwise-reload functions, or (None, None) before 0.20."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:  # pragma: no cover - older vLLM: load_weights writes in place
        return None, None
    return initialize_layerwise_reload, finalize_layerwise_reload
