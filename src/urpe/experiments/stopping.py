"""Stopping a sweep's worker processes with the sweep, however the sweep ends.

- SIGTERM to the main process is handled as Ctrl-C is (`Terminated`, a KeyboardInterrupt): the
  sweep stops its workers, keeps what is written and exits with status 143.
- SIGKILL cannot be handled, so each worker ends itself when its parent ends: on Linux through
  the parent-death signal (prctl PR_SET_PDEATHSIG), elsewhere by a thread watching its parent.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, poll_seconds: float = 1.0) -> None:
    """End this process (SIGKILL) when process `parent` ends, however it ends.

    On Linux the kernel sends the parent-death signal (prctl PR_SET_PDEATHSIG); a daemon thread
    that polls `os.getppid()` covers other systems. A worker killed this way loses at most the
    updates since its last checkpoint: records and checkpoints are written atomically.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="urpe-parent-watch", daemon=True).start()


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the sweep stops its workers and keeps what is written."""


def raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated
