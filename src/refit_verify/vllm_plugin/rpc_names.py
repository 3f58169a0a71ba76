"""Names of the worker methods the trainer side calls through ``collective_rpc`` (the contract between
the plugin's trainer and worker modules, so neither imports the other)."""

MANIFEST_METHOD = "refit_verify_native_manifest"
"""Returns the worker's manifest of the last native weight update (``native_worker``)."""
FINISH_METHOD = "refit_verify_native_finish"
"""Finishes vLLM's weight update and returns the manifest in the same call (``native_worker``)."""
VERSION_METHOD = "refit_verify_native_version"
"""Sets the weight version the worker's next native update opens its session with (``native_worker``)."""
ABANDON_METHOD = "refit_verify_native_abandon"
"""Records in the worker's open native update that the trainer's send into it raised (``native_worker``)."""
