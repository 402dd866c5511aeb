"""What a fresh AWS or GCP VM runs before spottrain is installed: the boot's loader.

Two standalone scripts, standard library only, written to the VM by its boot
(``controller/run/boot.py``) and run with the image's ``python3``: :mod:`.fetch` (in the
user data) fetches the rest of the boot from the run's store with the VM's own identity, and
:mod:`.loader` (fetched by it) reads secrets, configures pip and reports the boot's stages.
"""
