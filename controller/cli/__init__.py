"""The ``spottrain`` command line (the roof): its parser, one module per group of commands.

The console script is :func:`spottrain.controller.cli.main.main`; ``python -m
spottrain.controller.cli`` runs it too.
"""
