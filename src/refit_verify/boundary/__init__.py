"""The model boundary: the one place where a vLLM worker digests what it loads.

Whatever moved the bytes (our staged transport, the broadcast path, vLLM's native weight-transfer
engines, a framework's worker extension, TRL calling ``load_weights`` in its own process), a dense
refit ends in ``model.load_weights(weights)``. :class:`ModelBoundary` wraps that method on the
model instance (main model and drafter alike) and every parameter's ``weight_loader``
(:class:`~refit_verify.boundary.placement.LoaderTap`), so that within a **session** a worker records:

* the digest of every delivered ``(name, tensor)``, taken as the loader pulls it (positional or
  ``weights=`` calls, lists or lazy iterators; no reference is kept after the digest is launched);
* which delivered tensors some parameter consumed, and which parameters were written (coverage);
* the placement of each delivered tensor in the engine's parameters (for read-back);
* for loads that vLLM's layerwise reload defers (it keeps the tensors it is handed and writes a
  layer once all of it arrived), a second digest at apply time: a delivered tensor whose bytes
  changed in between (a view of memory refilled after ``load_weights`` returned) is reported as
  ``changed_after_delivery``, never as verified;
* **verify before load**: when the sender's digests came ahead of the bytes (our transport,
  :meth:`SessionDigests.expect`), the next ``load_weights`` call digests all its tensors first (one
  synchronisation per call on CUDA), compares them with the sender's and, in ``enforce``, hands
  the model only those that match: a refused tensor is never loaded (``refused``). A call
  in which nothing was refused is then replayed like any other (:mod:`refit_verify.boundary.plan`):
  the manifest's digest of a name is read where it landed. Which
  parameters then hold the new version and which kept the previous one is recorded with the
  session (:meth:`WorkerBoundary.note_kept`; the plugin puts a half-delivered fused layer back).

:class:`WorkerBoundary` holds one worker's boundaries, its identity, and the session in progress.
Sessions are opened explicitly (``refit_verify_session_open`` through ``collective_rpc``) or
implicitly (vLLM's ``start_weight_update``, our transport's handshake); an implicit open joins an
explicit session already open. A ``load_weights`` outside any session is recorded and reported
with the next session (``SessionManifest.unsessioned``).

:class:`ModelBoundary` (the wrappers of one model) lives in :mod:`refit_verify.boundary.model`; what
one module received within one session is recorded by :class:`refit_verify.boundary.record.ModuleSession`.
Nothing here imports vLLM: the plugin builds the boundaries (:mod:`refit_verify.vllm_plugin`).

Modules: :mod:`.worker` (:class:`WorkerBoundary`, :class:`SessionDigests`), :mod:`.model`
(:class:`ModelBoundary`), :mod:`.record` (what one module received in one session), :mod:`.plan`
(replay of a learned plan), :mod:`.placement` (the loaders' copies), :mod:`.regions` (write
regions), :mod:`.model_index`.

May import: ``digest``, ``compare``, the foundation. Never: ``stream``, ``transport``,
``collective``, ``engine`` (read-back is injected), ``trainer``, ``vllm_plugin``, vllm.
"""

from refit_verify._lazy import face

_EXPORTS = {
    "ModelBoundary": "refit_verify.boundary.model",
    "SessionDigests": "refit_verify.boundary.worker",
    "WorkerBoundary": "refit_verify.boundary.worker",
    "identity_of": "refit_verify.boundary.worker",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)
