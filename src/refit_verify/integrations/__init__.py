"""Integrations with RL frameworks that push weights into vLLM on their own (no transport of ours).

* :mod:`refit_verify.integrations.trl`: TRL's colocate weight sync, hooked by the plugin.
"""
