"""``python -m eeserve.server MODEL [--host H] [--port P] ...``: the same as ``eeserve serve``."""

from __future__ import annotations

import sys

from eeserve.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
