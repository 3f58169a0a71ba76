"""Timing helpers of a ``bench_paths`` child (``benchmarks/_paths_worker.py``): the garbage collector's
time, vLLM's native client calls timed one by one, and the ``--profile`` cProfile of the counted refits."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

pc = time.perf_counter


class GcTimer:
    """Seconds and collections of Python's cyclic garbage collector in this process (``gc.callbacks``):
    a collection that runs inside a refit is part of its wall time, and allocation-heavy code triggers more."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._t0 = 0.0, 0, None
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = pc()
        elif self._t0 is not None:
            self.seconds += pc() - self._t0
            self.collections += 1
            self._t0 = None


class TimedClient:
    """The four calls of vLLM's native API over an in-process ``LLM``, each timed into ``t``
    (``.llm`` is what refit-verify's trainer side finds to fetch the workers' manifests)."""

    def __init__(self, llm: Any, t: dict[str, float]) -> None:
        self.llm, self.t = llm, t

    def _timed(self, key: str, fn, *args) -> None:
        a = pc()
        try:
            fn(*args)
        finally:
            self.t[key] = self.t.get(key, 0.0) + pc() - a
            self.t[key + "_n"] = self.t.get(key + "_n", 0) + 1

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self._timed("c.start", self.llm.start_weight_update)

    def update_weights(self, update_info: dict) -> None:
        self._timed("c.update", self.llm.update_weights, {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._timed("c.finish", self.llm.finish_weight_update)


class Profile:
    """cProfile of the counted refits of each path (``--profile``).

    Profiled runs are slower than measured ones: use a separate run with few rounds.
    """

    def __init__(self, out: str) -> None:
        import cProfile

        self.out = out
        self.prof: dict[str, cProfile.Profile] = {}
        self.runs: dict[str, int] = {}
        self.extras: dict[str, cProfile.Profile] = {}

    def extra(self, title: str):
        """A further profile written under ``title`` (e.g. one another thread enables)."""
        import cProfile

        return self.extras.setdefault(title, cProfile.Profile())

    def run(self, path: str, fn):
        import cProfile

        p = self.prof.setdefault(path, cProfile.Profile())
        self.runs[path] = self.runs.get(path, 0) + 1
        p.enable()
        try:
            return fn(path)
        finally:
            p.disable()

    def write(self) -> None:
        import io
        import pstats

        buf = io.StringIO()
        for path, p in self.prof.items():
            buf.write(f"\n===== {path}: {self.runs[path]} profiled refits =====\n")
            st = pstats.Stats(p, stream=buf)
            st.sort_stats("tottime").print_stats(45)
            st.sort_stats("cumulative").print_stats("refit_verify", 120)
            st.sort_stats("tottime").print_stats("refit_verify", 60)
        for title, p in self.extras.items():
            if p.getstats():
                buf.write(f"\n===== {title} =====\n")
                st = pstats.Stats(p, stream=buf)
                st.sort_stats("tottime").print_stats(45)
                st.sort_stats("cumulative").print_stats(60)
        Path(self.out).write_text(buf.getvalue())
