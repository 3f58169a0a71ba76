"""vLLM worker extension of a profiled ``bench_paths`` run (``--profile DIR``, ``mp`` engines).

An ``mp`` engine's worker runs in a process of its own, where the child's cProfile cannot see: the
child starts such an engine with ``worker_extension_cls="benchmarks._paths_ext.WorkerProfile"`` and,
around every counted refit, calls ``collective_rpc("bench_profile", args=("start",))`` / ``("stop",)``;
at the end ``("write", FILE)``. The profile then holds the worker's side of those refits (its main
thread: where vLLM runs every ``collective_rpc``, including ``refit_verify_receive`` and vLLM's own
``update_weights``). The start and stop calls themselves are outside the child's timed region.
"""

from __future__ import annotations


class WorkerProfile:
    """Mixed into vLLM's worker by ``worker_extension_cls``; one method, reached through ``collective_rpc``."""

    def bench_profile(self, op: str, out: str = "") -> int:
        """``op``: ``"start"`` / ``"stop"`` (enable / disable cProfile in this thread), ``"write"`` (stats to
        ``out``). Returns how many profiled spans so far."""
        import cProfile
        import io
        import pstats

        st = self.__dict__.setdefault("_bench_profile", {"prof": cProfile.Profile(), "spans": 0})
        if op == "start":
            st["prof"].enable()
            st["spans"] += 1
        elif op == "stop":
            st["prof"].disable()
        elif op == "write":
            buf = io.StringIO()
            buf.write(f"===== worker process: {st['spans']} profiled refits =====\n")
            st["prof"].create_stats()
            if not st["prof"].stats:  # pstats refuses an empty profile
                buf.write("no calls were profiled\n")
                with open(out, "w") as f:
                    f.write(buf.getvalue())
                return st["spans"]
            s = pstats.Stats(st["prof"], stream=buf)
            s.sort_stats("tottime").print_stats(50)
            s.sort_stats("cumulative").print_stats(80)
            with open(out, "w") as f:
                f.write(buf.getvalue())
        else:
            raise ValueError(f"bench_profile: unknown op {op!r}")
        return st["spans"]
