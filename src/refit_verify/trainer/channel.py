"""Reaching every worker of a vLLM engine from the trainer, whatever the engine is.

:func:`channel` turns what a framework holds into a :class:`WorkerChannel`, whose :meth:`call`
runs a worker method on every worker and returns one result per worker:

* an object with a synchronous ``collective_rpc`` (``vllm.LLM``, an engine client): called directly
  (``timeout=`` bounds it where the method accepts one; for a ``vllm.LLM`` whose engine core runs in
  another process the wait is bounded from a helper thread too, since vLLM's timeout does not count
  the time a call is queued behind another);
* a Ray actor handle whose actor owns the engine and exposes ``collective_rpc``, or a list of them
  (one per engine replica): ``handle.collective_rpc.remote(...)``, waited for with ``ray.get(timeout=)``;
* an HTTP base URL of a ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` (its ``POST /collective_rpc``
  route), or a client with a ``base_url``;
* a client holding one of these as an attribute (``VLLMWeightSyncClient`` and similar), or a bound
  method of one.

Arguments and results are plain builtins (str, int, float, bool, None, lists, dicts): they cross
msgpack, JSON and Ray unchanged. Nothing is pickled by refit-verify. One exception never crosses a
process: a session close through a :attr:`WorkerChannel.local` channel may come back as the worker's
:class:`~refit_verify.manifest.SessionManifest` itself, from a worker in the caller's own process.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
from collections.abc import Callable
from typing import Any

from refit_verify.errors import RefitConfigError, RefitError, RefitProtocolError, RefitTimeoutError

__all__ = ["WorkerChannel", "channel"]

DEFAULT_TIMEOUT_S = 120.0
GRACE_S = 2.0
"""Seconds a call into another process may take beyond its own ``timeout`` before it is given up on."""


class WorkerChannel:
    """Runs a worker method on every worker of one or more engines.

    Args:
        calls: one function per engine, ``f(method, args, timeout_s) -> list`` (one result per worker).
        label: how the engine was reached (for messages).
        local: the engine's core runs in this process (vLLM's ``InprocClient``,
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and is called directly: the trainer then offers its
            :func:`~refit_verify.manifest.local_reply_token` with a session close, and a worker that is
            in this process too (not one of an ``mp`` executor) answers with the record itself.
    """

    def __init__(self, calls: list[Callable[[str, tuple, float], list]], label: str, local: bool = False) -> None:
        self._calls, self.label, self.local = calls, label, local

    def call(self, method: str, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """Run ``method(*args)`` on every worker; return the results in engine, then worker order.

        Raises:
            RefitTimeoutError: an engine did not answer within ``timeout_s`` seconds.
            RefitConfigError: an engine lacks the method (refit-verify not installed there), or
                answered for no worker at all (an empty list: nothing there could be checked).
            RefitProtocolError: the method failed on a worker (its message is kept); an in-process
                worker's own refit-verify error is raised as it is.
        """
        out: list[Any] = []
        for i, f in enumerate(self._calls):
            try:
                res = f(method, args, timeout_s)
            except RefitTimeoutError:
                raise
            except TimeoutError as e:
                raise RefitTimeoutError(f"refit-verify: {method} did not answer within {timeout_s:g} s through {self.label}",
                                        {"waiting_for": method, "timeout_s": timeout_s}) from e
            except RefitError:
                raise  # an in-process worker's own error, as it is
            except Exception as e:
                if type(e).__name__ == "GetTimeoutError":  # ray.exceptions.GetTimeoutError
                    raise RefitTimeoutError(f"refit-verify: {method} did not answer within {timeout_s:g} s through {self.label}",
                                            {"waiting_for": method, "timeout_s": timeout_s}) from e
                text = f"{type(e).__name__}: {e}"
                if isinstance(e, AttributeError) or "has no attribute" in text or "not found" in text.lower():
                    raise RefitConfigError(f"refit-verify: {method} failed through {self.label} ({text}); "
                                           "is refit-verify installed in the vLLM engine's environment?") from e
                raise RefitProtocolError(f"refit-verify: {method} failed on a worker through {self.label}: {text}"[:2000]) from e
            if not res:
                raise _no_worker(method, self.label + (f", engine {i + 1} of {len(self._calls)}" if len(self._calls) > 1 else ""))
            out.extend(res)
        return out


def _no_worker(method: str, where: str) -> RefitConfigError:
    """The error for an engine whose ``collective_rpc`` answered with an empty list."""
    return RefitConfigError(f"refit-verify: {method} through {where} answered for no worker (an empty result list): "
                            "no vLLM worker was reached, so nothing can be checked there")


def _is_ray_handle(obj: Any) -> bool:
    return callable(getattr(getattr(obj, "collective_rpc", None), "remote", None))


def _core(target: Any) -> Any:
    """The engine-core client of a ``vllm.LLM``, ``LLMEngine`` or engine-core client, or None."""
    core = getattr(getattr(target, "llm_engine", None), "engine_core", None)  # vllm.LLM
    if core is None:
        core = getattr(target, "engine_core", None)  # vllm's LLMEngine
    if core is None and type(target).__name__.endswith("Client"):
        core = target  # an engine-core client itself (SyncMPClient, ...)
    return core


def _in_other_process(target: Any) -> bool:
    """True for a ``vllm.LLM``, ``LLMEngine`` or engine-core client whose engine core runs in another
    process (V1 multiprocessing): its ``collective_rpc`` only waits in the calling thread, so the
    wait can be bounded from another one. An in-process engine core runs the call in this thread."""
    core = _core(target)
    return core is not None and type(core).__name__ != "InprocClient"


def _in_this_process(target: Any) -> bool:
    """True only for a ``vllm.LLM``, ``LLMEngine`` or client whose engine core is vLLM's in-process one
    (``InprocClient``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Its workers may still run elsewhere (an
    ``mp`` executor); any other object with a ``collective_rpc`` (a wrapper forwarding to another
    process, perhaps to an older refit-verify) is not taken for one."""
    core = _core(target)
    return core is not None and type(core).__name__ == "InprocClient"


def _bounded(f: Callable[[], list], what: str, timeout_s: float) -> list:
    """Run ``f`` in a daemon thread and wait at most ``timeout_s + GRACE_S`` seconds for it.

    vLLM's ``collective_rpc(timeout=)`` does not count the time a call waits behind another one
    (a long generation, another RPC); this bound does. A call given up on may still run later: the
    worker refuses a session open that arrives after its deadline.

    Raises:
        TimeoutError: ``f`` did not return in time.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = f()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e

    th = threading.Thread(target=run, name=f"refit-verify {what}", daemon=True)
    th.start()
    th.join(timeout_s + GRACE_S)
    if th.is_alive():
        raise TimeoutError(f"{what} did not answer within {timeout_s:g} s (+{GRACE_S:g} s): the workers may be busy with "
                           "another collective_rpc or a generation")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _takes_timeout(rpc: Callable) -> bool:
    """Whether ``rpc`` (an engine's ``collective_rpc``) takes ``timeout``."""
    try:
        return "timeout" in inspect.signature(rpc).parameters
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=64)
def _method_takes_timeout(func: Callable) -> bool:
    """:func:`_takes_timeout` of a method bound to any instance of its class, read once per
    function (a signature costs about 45 µs, and a refit resolves its engine's channel at every
    ``refit()``); ``func`` is the class's function, which holds no engine."""
    try:
        return "timeout" in list(inspect.signature(func).parameters)[1:]  # the first is the instance
    except (TypeError, ValueError):
        return False


def _direct(rpc: Callable, threaded: bool = False, local: bool = False) -> Callable[[str, tuple, float], list]:
    if inspect.ismethod(rpc) and inspect.isfunction(rpc.__func__) and not inspect.isclass(rpc.__self__):
        takes_timeout = _method_takes_timeout(rpc.__func__)
    else:  # a function, a closure, a partial, a callable object, a classmethod: read each time (nothing kept)
        takes_timeout = _takes_timeout(rpc)

    def call(method: str, args: tuple, timeout_s: float) -> list:
        kw: dict[str, Any] = {"args": args} if args else {}
        if takes_timeout:
            kw["timeout"] = timeout_s
        if threaded:
            return list(_bounded(lambda: rpc(method, **kw), method, timeout_s))
        return list(rpc(method, **kw))

    call.local = local  # type: ignore[attr-defined]  # WorkerChannel.local
    return call


def _ray(handles: list) -> Callable[[str, tuple, float], list]:
    def call(method: str, args: tuple, timeout_s: float) -> list:
        import ray

        out: list = []
        for i, res in enumerate(ray.get([h.collective_rpc.remote(method, args=args) for h in handles], timeout=timeout_s)):
            if not res:
                raise _no_worker(method, f"Ray actor handle {i + 1} of {len(handles)}")
            out.extend(res)
        return out

    return call


def _http(base_url: str) -> Callable[[str, tuple, float], list]:
    def call(method: str, args: tuple, timeout_s: float) -> list:
        import requests

        body = {"method": method, "args": [a if isinstance(a, str) else json.dumps(a) for a in args], "timeout": timeout_s}
        try:
            r = requests.post(f"{base_url.rstrip('/')}/collective_rpc", json=body, timeout=timeout_s + 10)
        except requests.Timeout as e:
            raise TimeoutError(str(e)) from e
        r.raise_for_status()
        return list(r.json().get("results", []))

    return call


def _resolve(target: Any, depth: int = 0) -> tuple[Callable[[str, tuple, float], list], str] | None:
    if target is None or depth > 2:
        return None
    if isinstance(target, str):
        return _http(target), f"HTTP {target}"
    handles = target if isinstance(target, list) else getattr(target, "handles", None)
    if isinstance(handles, list) and handles and all(_is_ray_handle(h) for h in handles):
        return _ray(handles), f"{len(handles)} Ray actor handle(s)"
    if _is_ray_handle(target):
        return _ray([target]), "a Ray actor handle"
    rpc = getattr(target, "collective_rpc", None)
    if callable(rpc) and not inspect.iscoroutinefunction(rpc):
        return _direct(rpc, threaded=_in_other_process(target), local=_in_this_process(target)), type(target).__name__
    base_url = getattr(target, "base_url", None)
    if isinstance(base_url, str):
        return _http(base_url), f"HTTP {base_url}"
    owner = getattr(target, "__self__", None)  # a bound method (a 0.26 send_mode callable)
    if owner is not None and owner is not target:
        found = _resolve(owner, depth + 1)
        if found is not None:
            return found
    for value in list(getattr(target, "__dict__", {}).values()):  # a client holding an LLM / handle
        if value is target or isinstance(value, (str, int, float, bool, type(None))):
            continue
        r = getattr(value, "collective_rpc", None)
        if _is_ray_handle(value) or (callable(r) and not inspect.iscoroutinefunction(r)):
            return _resolve(value, depth + 1)
    return None


def channel(target: Any) -> WorkerChannel | None:
    """Return a :class:`WorkerChannel` to the workers behind ``target``, or None if none is found."""
    if isinstance(target, WorkerChannel):
        return target
    found = _resolve(target)
    if found is None:
        return None
    call, label = found
    return WorkerChannel([call], label, local=getattr(call, "local", False))


def require_channel(target: Any) -> WorkerChannel:
    """Like :func:`channel`, raising when ``target`` reaches no workers.

    Raises:
        RefitConfigError: ``target`` is none of the forms :mod:`refit_verify.trainer.channel` knows.
    """
    ch = channel(target)
    if ch is None:
        raise RefitConfigError(
            f"refit-verify cannot reach the vLLM workers through {type(target).__name__}: pass a vllm.LLM (or an object with "
            "collective_rpc), a Ray actor handle whose actor exposes collective_rpc, or the HTTP base URL of a vLLM server "
            "started with VLLM_SERVER_DEV_MODE=1")
    return ch
