"""Importing this module creates the file named by ``$SECURITY_PROBE_MARKER``: the
security tests (python/tests/bridge/test_security_allowlist.py) check that no request makes a
worker import it, since it is not on the allow-list."""

import os
from pathlib import Path

_marker = os.environ.get("SECURITY_PROBE_MARKER")
if _marker:
    Path(_marker).touch()
