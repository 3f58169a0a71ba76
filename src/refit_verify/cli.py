"""refit-verify command line. demo: a verified refit into a real vLLM engine, then one with an injected fault."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``refit-verify`` console script. Returns the process exit code."""
    p = argparse.ArgumentParser(prog="refit-verify", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="verified refit into a real vLLM engine, clean and with an injected fault",
                       description="Start vLLM on a small config with dummy weights, push fresh weights with REFIT_VERIFY=enforce, "
                                   "read them back, then repeat with one staged byte flipped. Exit 0 only if both outcomes are as expected.")
    d.add_argument("--model", default=None, help="directory with config.json (default: the packaged tiny Llama)")
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="staging device (auto: cuda if available)")
    d.add_argument("--seed", type=int, default=1234, help="seed of the trainer-side random weights")
    d.add_argument("--timeout", type=float, default=120.0, help="bound on every transport wait, seconds")
    d.add_argument("--buffer-mib", type=int, default=4, help="staging budget in MiB (two ping-pong halves)")
    args = p.parse_args(argv)
    if args.cmd == "demo":
        from refit_verify.demo import run_demo
        from refit_verify.errors import RefitConfigError

        if args.buffer_mib <= 0:
            p.error("--buffer-mib must be a positive number of MiB")
        if not (args.timeout > 0 and args.timeout < float("inf")):
            p.error("--timeout must be a positive, finite number of seconds")
        try:
            return run_demo(model=args.model, device=args.device, seed=args.seed, timeout_s=args.timeout, buffer_bytes=args.buffer_mib << 20)
        except RefitConfigError as e:
            p.error(str(e))
    return 2


if __name__ == "__main__":
    sys.exit(main())
