"""The parts of ``bench/replica.py``: the pure figures, and each mode's run."""
