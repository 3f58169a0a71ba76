"""What a trainer calls: a refit check around its own push, our transport's one-call push, audits.

Modules: :mod:`.refit` (:func:`~refit_verify.trainer.refit.refit`, ``RefitCheck``), :mod:`.exports`
(digests of the tensors a trainer pushes), :mod:`.channel` (reaching the workers: ``LLM``, Ray actor,
HTTP), :mod:`.push` (:func:`~refit_verify.trainer.push.push`), :mod:`.overlap` (digest work run while
the engine waits), :mod:`.audits` (audits, replica agreement, version certificates), :mod:`.selftest`
(does verification work on this engine?), :mod:`.adapters` (LoRA adapters pushed through vLLM's LoRA
manager: :func:`~refit_verify.trainer.adapters.verify_adapter`, ``audit_adapters``).

May import: ``transport`` (for ``push``), ``digest``, the foundation. Never: ``boundary``, ``engine``
(the trainer reaches the workers by RPC only), ``vllm_plugin``.
"""

from refit_verify.digest import warm_start

warm_start.install()  # torch imported after refit_verify: the warm-up still starts ahead of the first refit
