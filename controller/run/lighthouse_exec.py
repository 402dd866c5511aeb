"""``python lighthouse_exec.py --bind ... --min_replicas ...``: torchft's own lighthouse,
started without importing torch.

The ``torchft_lighthouse`` script imports the ``torchft`` package, whose ``__init__`` imports
torch: 1.7 s on an idle 2-core machine, 3-5 s on a busy one, before it serves, and every
second of it is downtime when the lighthouse restarts. The lighthouse is Rust code in the
extension ``torchft._torchft`` and needs nothing of torch, so this loads that extension by
its file and runs the same entry point the script runs. The entry point parses the process's
command line after the interpreter, so this runs as a script file (never ``-c`` or ``-m``).

It imports nothing of spottrain: it is a process of its own, started by
:mod:`spottrain.controller.run.lighthouse`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def main() -> int:
    found = importlib.util.find_spec("torchft")  # finds the package without importing it
    folders = list(found.submodule_search_locations or []) if found else []
    extensions = [p for f in folders for p in Path(f).glob("_torchft.*.so")]
    if not extensions:
        print(
            "torchft's extension is not installed: pip install 'spottrain[replica]'",
            file=sys.stderr,
        )
        return 2
    spec = importlib.util.spec_from_file_location("_torchft", extensions[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.lighthouse_main() or 0)


if __name__ == "__main__":
    raise SystemExit(main())
