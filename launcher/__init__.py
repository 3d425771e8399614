"""The launcher: starts, wires and supervises every process of a run, or joins a running one (`scripts/launch.py`)."""
