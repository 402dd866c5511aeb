"""Test and demo helpers, not used by a running agent.

:mod:`.local_launcher` starts the nodes of a job as process groups on one machine and does
to them what a spot fleet does (the demos, the benchmarks and the end-to-end tests use it).
"""
