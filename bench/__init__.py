"""The benchmarks: one module each, run as a command; `bench/harness.py` holds what they share.

    .venv/bin/python -m bench.broker          # every benchmark: --help lists its sizes; docs/benchmarks.md
    .venv/bin/python -m bench.peer --learn

Each prints a table and its ratio last, and measures its baseline in the same run. Nothing of the system imports
this package (it sits beside the launcher, as the tests do); it imports nothing here, so that
`python -m bench.peer_trl` runs in the peer's own venv.
"""
