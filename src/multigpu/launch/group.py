"""One replica group of ``multigpu run --fault-tolerant``: an ordinary run of the launcher's configuration
(without the flag), started by replicas.py as ``python -m multigpu.launch.group CONFIG_JSON``."""

from __future__ import annotations

import json
import sys

from .config import RunConfig
from .start import launch

if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    fields["args"] = tuple(fields["args"])
    sys.exit(launch(RunConfig(**fields)))
