"""Elastic rendezvous for torchrun on Redis.

Nothing here imports torch at package import time: torchrun loads our entry point while it is
still initialising its own rendezvous package (see :mod:`.plugin`).
"""
