"""A process that holds a (FAKE guest's) GPU node open under a name of our choosing.

    python tests/fast/fm_holder.py NAME NODE

Sets its comm to NAME (prctl PR_SET_NAME: the first 15 bytes, any byte but NUL), opens NODE,
prints "holding" and sleeps until killed.
"""

import ctypes
import os
import sys
import time

PR_SET_NAME = 15

name, node = sys.argv[1], sys.argv[2]
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, os.fsencode(name), 0, 0, 0)
held = open(node, "rb")  # noqa: SIM115 (held until killed)
print("holding", flush=True)
while True:
    time.sleep(3600)
