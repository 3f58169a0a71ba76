"""What the engine holds: read-back of a session's writes in the engine's layout, the engine-state
snapshot after a session, and audits of it.

Modules: :mod:`.readback` (:func:`~refit_verify.engine.readback.read_back`), :mod:`.fills` (the padding loaders filled), :mod:`.state`
(:func:`~refit_verify.engine.state.snapshot`, :func:`~refit_verify.engine.state.audit`),
:mod:`.adapters` (LoRA slot regions, their padding, and the adapters each worker verified), :mod:`.quantized`
(parameters quantized on load), :mod:`.forward` (linear weights in a GEMM kernel, proven through the layer's forward).
Comparisons of states and replicas are in :mod:`refit_verify.compare`.

May import: ``boundary``, ``digest``, the foundation. Never: ``trainer``, ``vllm_plugin``.
"""
