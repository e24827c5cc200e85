"""Command line: ``python -m pyro_hier demo [--steps N] [--out FILE] [--quick]``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pyro_hier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit guides to problems with known answers and print a comparison table")
    demo.add_argument("--steps", type=int, default=5000, help="optimisation steps per guide (default 5000)")
    demo.add_argument("--out", default="pyro_hier_demo.png", help="where to write the ELBO-trace plot")
    demo.add_argument("--quick", action="store_true", help="a small problem and few steps, for smoke tests")
    demo.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the demo's models are small, and one thread "
        "is as fast and does not slow down when other programs share the cores)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        import torch

        from pyro_hier.demo import run_demo

        torch.set_num_threads(args.threads)
        run_demo(steps=args.steps, out=args.out, quick=args.quick)


if __name__ == "__main__":
    main()
