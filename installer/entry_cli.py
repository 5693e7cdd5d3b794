"""Frozen entry point of the `hearth` command (the bundle's copy of engine.cli:main)."""

import multiprocessing
import sys

if __name__ == "__main__":
    # the engine worker is a "spawn" child: in a frozen app it is this executable, started with
    # multiprocessing's arguments, which freeze_support() recognises and runs instead of the CLI
    multiprocessing.freeze_support()
    from engine.cli import main

    sys.exit(main())
