"""Trainer side of refit-verify's own broadcast path into vLLM workers: joining the process group.

The workers join with ``collective_rpc("refit_verify_broadcast_init", ...)``
(:mod:`refit_verify.vllm_plugin.worker_methods`); the trainer with :func:`broadcast_group`.
"""

from __future__ import annotations

import math

DEFAULT_GROUP_TIMEOUT_S = 600.0
"""Default bound, in seconds, on joining a broadcast group and on every collective run on it."""


def broadcast_group(host: str, port: int, rank: int, world_size: int, backend: str | None = None,
                    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S):
    """Join a process group for :mod:`refit_verify.collective.broadcast` without touching torch's global state.

    The group is made by vLLM's ``stateless_init_torch_distributed_process_group``: it is not the
    default group and is not registered in torch's global maps, so it can be formed by an external
    trainer process and the workers of a vLLM engine (whose default group is their own TP world).
    Rank 0 hosts the rendezvous (a ``TCPStore`` listening on ``host:port``); every member blocks
    until all ``world_size`` members joined, so the trainer and the workers must join concurrently
    (run ``collective_rpc("refit_verify_broadcast_init", ...)`` in a thread, or join the trainer in
    one). The rank rule of the workers: worker ``i`` (``dp_index * TP * PP + rank``) joins as
    ``rank_offset + i``; with one trainer rank at 0, ``world_size = 1 + number of workers``.

    Args:
        host: address of rank 0's rendezvous store, reachable from every member.
        port: a free TCP port on ``host`` (1..65535).
        rank: this process's rank in the group, ``0 <= rank < world_size``; rank 0 hosts the store.
        world_size: number of members (>= 2).
        backend: ``"nccl"`` (the bytes move on the current CUDA device: call
            ``torch.cuda.set_device`` first) or ``"gloo"`` (CPU); default ``"nccl"`` when CUDA is
            available, else ``"gloo"``.
        timeout_s: seconds; bounds the join and every collective on the group (> 0, <= 86400).
            A vLLM whose helper takes no ``timeout`` (0.26) joins within the backend's default
            (30 min for gloo, 10 min for NCCL); ``timeout_s`` is then set on the group's backends
            after the join, so it still bounds every collective.

    Returns:
        torch.distributed.ProcessGroup: pass it as ``group`` to
        :class:`~refit_verify.collective.broadcast.BroadcastSender` with ``src`` = this rank (``group.rank()``).
        Release it with ``group.shutdown()``.

    Raises:
        RefitConfigError: an argument is out of range, ``backend`` is not ``nccl``/``gloo`` (or is
            ``nccl`` without CUDA), or object collectives cannot run on such a group in this process (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with NCCL built in).
        ImportError: vLLM is not installed.
        RuntimeError / DistStoreError: the rendezvous failed or timed out.
    """
    import inspect
    import logging
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from refit_verify.errors import RefitConfigError

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not isinstance(host, str) or not host:
        raise RefitConfigError(f"broadcast_group: host must be a non-empty string, got {host!r}")
    for name, v, lo, hi in (("port", port, 1, 65535), ("world_size", world_size, 2, None), ("rank", rank, 0, None)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise RefitConfigError(f"broadcast_group: {name} must be an int in [{lo}, {hi or 'inf'}], got {v!r}")
    if rank >= world_size:
        raise RefitConfigError(f"broadcast_group: rank {rank} is not below world_size {world_size}")
    if not isinstance(backend, str) or backend.lower() not in ("nccl", "gloo"):
        raise RefitConfigError(f"broadcast_group: backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend.lower() == "nccl" and not torch.cuda.is_available():
        raise RefitConfigError("broadcast_group: backend 'nccl' needs a CUDA device in this process; use 'gloo'")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or not 0 < timeout_s <= 86400:
        raise RefitConfigError(f"broadcast_group: timeout_s must be a finite number of seconds in (0, 86400], got {timeout_s!r}")
    if dist.is_nccl_available() and (dist.get_debug_level() == dist.DebugLevel.DETAIL
                                     or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"):
        # torch's _object_to_tensor/_tensor_to_object then call dist.get_backend(group) on every
        # object, which raises ValueError for a group outside torch's global maps.
        raise RefitConfigError("broadcast_group: TORCH_DISTRIBUTED_DEBUG=DETAIL breaks torch's object collectives on "
                               "unregistered process groups (get_backend(group) raises); unset it or use INFO")
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group as init

    timeout = timedelta(seconds=float(timeout_s))
    if "timeout" in inspect.signature(init).parameters:
        return init(host, port, rank, world_size, backend.lower(), timeout=timeout)
    # vLLM 0.26: its helper takes no timeout; set it on the group's gloo/NCCL backends after the join
    group = init(host, port, rank, world_size, backend.lower())
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout, group)  # uses only the group object (works on unregistered groups)
    except Exception as e:  # noqa: BLE001 - a torch without it: the backend's default applies
        logging.getLogger("refit_verify").warning("broadcast_group: timeout_s=%s could not be set on the group (%s: %s); "
                                                  "the backend's default timeout applies", timeout_s, type(e).__name__, e)
    return group
