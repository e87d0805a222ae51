"""`die_with_parent`, the `preexec_fn` of every long-running child the e2e tests start.

conftest.py's hang guard ends a hung run with faulthandler's `_exit`: no fixture teardown runs
then, so a child that outlived pytest (a node, a source, moto, dnsmasq, Azurite, the impairment
loop) would keep running. With PR_SET_PDEATHSIG the kernel sends the child SIGKILL when the
thread that forked it ends; pytest runs tests (and so starts children) in its main thread.

Its own module (not conftest.py) so that s3server.py, dnsfix.py and impair.py (also run as a
script) can use it without importing pytest.
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1
# Resolved now, not in the child: between fork and exec the child must import nothing.
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_SIGKILL = int(signal.SIGKILL)


def die_with_parent() -> None:
    """Between fork and exec: SIGKILL this child when its parent thread ends (Linux)."""
    if _prctl(PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
