"""``python -m spottrain.controller.cli``: the ``spottrain`` command line."""

import sys

from spottrain.controller.cli.main import main

sys.exit(main())
