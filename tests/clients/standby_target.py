"""An engine module for the standby tests: the real receiver, with its import and its start recorded in the
file STANDBY_TARGET_RECORD names (when its import ran, when `main` ran, with which argv)."""

from __future__ import annotations

import json
import os
import sys
import time

from titan_lora.engines import receiver

IMPORTED_AT = time.time()


def main() -> None:
    """Record, then serve as the receiver."""
    record = os.environ.get("STANDBY_TARGET_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "imported_at": IMPORTED_AT, "main_at": time.time(),
                                "argv": sys.argv[1:],
                                "changed": os.environ.get("STANDBY_TEST_CHANGED")}) + "\n")
    receiver.main()


if __name__ == "__main__":
    main()
