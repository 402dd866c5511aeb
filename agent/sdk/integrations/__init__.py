"""Bring your own training code: spottrain's checkpoint on a notice, resume and progress for
scripts on the Hugging Face ``Trainer``, Accelerate, PyTorch Lightning or plain torchrun,
each through one object the script adds (see ``docs/integrations.md``).

:mod:`.core` holds what they share (the agreement on a save step, the commit of a directory
the framework wrote, the newest complete checkpoint, progress); each framework's module
imports its framework only when used.
"""
