"""Sweeps (`python tools/sweep.py`): the spec, the runner, the report, and the sweep files beside them."""
