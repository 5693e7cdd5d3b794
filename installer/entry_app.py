"""Frozen entry point of the `hearth-app` desktop app (the bundle's copy of app.main:main)."""

import multiprocessing
import sys

if __name__ == "__main__":
    # before Qt loads: a spawned engine worker re-runs this executable with multiprocessing's arguments
    multiprocessing.freeze_support()
    from app.main import main

    sys.exit(main())
