"""`hearth bench --draft DRAFT` / `--lookup`: the speculative-decoding options of the bench command.

Parsing only (no heavy imports): engine.cli calls add_spec_bench_args on the bench subparser, and
engine.commands.cmd_bench hands the run to engine.bench_spec when either option is set.
"""

from __future__ import annotations

import argparse


def add_spec_bench_args(bench: argparse.ArgumentParser) -> None:
    """Add --draft, --lookup, -k/--spec-k, --fixed-k and --notes to the bench subparser."""
    bench.add_argument(
        "--draft",
        metavar="DRAFT",
        default=None,
        help="speculative decoding with this draft model (path or starter name; same tokenizer as -m): "
        "greedy decode tok/s with and without, acceptance, whether the outputs were identical",
    )
    bench.add_argument(
        "--lookup",
        action="store_true",
        help="speculative decoding by prompt lookup (n-grams of the prompt) on repeat-with-a-change prompts",
    )
    bench.add_argument("-k", "--spec-k", type=int, default=4, help="draft length to start from (default 4)")
    bench.add_argument(
        "--fixed-k", action="store_true", help="keep the draft length fixed (no adaptation, never off)"
    )
    bench.add_argument(
        "--notes",
        type=int,
        default=0,
        metavar="N",
        help="with --draft / --lookup: start every prompt with about N tokens of notes, to measure at a "
        "longer context (attention's share of each pass grows with it)",
    )


def wants_speculative_bench(args) -> bool:
    return bool(getattr(args, "draft", None) or getattr(args, "lookup", False))
