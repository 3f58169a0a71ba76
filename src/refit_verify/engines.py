"""Reaching every worker of a vLLM engine from the trainer, whatever the engine is.

:func:`channel` turns what a framework holds into a :class:`WorkerChannel`, whose :meth:`call`
runs a worker method on every worker and returns one result per worker:

* an object with a synchronous ``collective_rpc`` (``vllm.LLM``, an engine client): called directly
  (``timeout=`` bounds it where the method accepts one);
* a Ray actor handle whose actor owns the engine and exposes ``collective_rpc``, or a list of them
  (one per engine replica): ``handle.collective_rpc.remote(...)``, waited for with ``ray.get(timeout=)``;
* an HTTP base URL of a ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` (its ``POST /collective_rpc``
  route), or a client with a ``base_url``;
* a client holding one of these as an attribute (``VLLMWeightSyncClient`` and similar), or a bound
  method of one.

Arguments and results are plain builtins (str, int, float, bool, None, lists, dicts): they cross
msgpack, JSON and Ray unchanged. Nothing is pickled by refit-verify.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from refit_verify.errors import RefitConfigError, RefitTimeoutError

__all__ = ["WorkerChannel", "channel"]

DEFAULT_TIMEOUT_S = 120.0


class WorkerChannel:
    """Runs a worker method on every worker of one or more engines.

    Args:
        calls: one function per engine, ``f(method, args, timeout_s) -> list`` (one result per worker).
        label: how the engine was reached (for messages).
    """

    def __init__(self, calls: list[Callable[[str, tuple, float], list]], label: str) -> None:
        self._calls, self.label = calls, label

    def call(self, method: str, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """Run ``method(*args)`` on every worker; return the results in engine, then worker order.

        Raises:
            RefitTimeoutError: an engine did not answer within ``timeout_s`` seconds.
            RefitConfigError: an engine lacks the method (refit-verify not installed there) or the call failed.
        """
        out: list[Any] = []
        for f in self._calls:
            try:
                res = f(method, args, timeout_s)
            except RefitTimeoutError:
                raise
            except TimeoutError as e:
                raise RefitTimeoutError(f"refit-verify: {method} did not answer within {timeout_s:g} s through {self.label}",
                                        {"waiting_for": method, "timeout_s": timeout_s}) from e
            except Exception as e:
                if type(e).__name__ == "GetTimeoutError":  # ray.exceptions.GetTimeoutError
                    raise RefitTimeoutError(f"refit-verify: {method} did not answer within {timeout_s:g} s through {self.label}",
                                            {"waiting_for": method, "timeout_s": timeout_s}) from e
                raise RefitConfigError(f"refit-verify: {method} failed through {self.label} ({type(e).__name__}: {e}); "
                                       "is refit-verify installed in the vLLM engine's environment?") from e
            out.extend(res or [])
        return out


def _is_ray_handle(obj: Any) -> bool:
    return callable(getattr(getattr(obj, "collective_rpc", None), "remote", None))


def _direct(rpc: Callable) -> Callable[[str, tuple, float], list]:
    try:
        takes_timeout = "timeout" in inspect.signature(rpc).parameters
    except (TypeError, ValueError):
        takes_timeout = False

    def call(method: str, args: tuple, timeout_s: float) -> list:
        kw: dict[str, Any] = {"args": args} if args else {}
        if takes_timeout:
            kw["timeout"] = timeout_s
        return list(rpc(method, **kw))

    return call


def _ray(handles: list) -> Callable[[str, tuple, float], list]:
    def call(method: str, args: tuple, timeout_s: float) -> list:
        import ray

        out: list = []
        for res in ray.get([h.collective_rpc.remote(method, args=args) for h in handles], timeout=timeout_s):
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
        return _direct(rpc), type(target).__name__
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
    return WorkerChannel([call], label)


def require_channel(target: Any) -> WorkerChannel:
    """Like :func:`channel`, raising when ``target`` reaches no workers.

    Raises:
        RefitConfigError: ``target`` is none of the forms :mod:`refit_verify.engines` knows.
    """
    ch = channel(target)
    if ch is None:
        raise RefitConfigError(
            f"refit-verify cannot reach the vLLM workers through {type(target).__name__}: pass a vllm.LLM (or an object with "
            "collective_rpc), a Ray actor handle whose actor exposes collective_rpc, or the HTTP base URL of a vLLM server "
            "started with VLLM_SERVER_DEV_MODE=1")
    return ch
