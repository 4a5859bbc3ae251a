"""Prints its pid, then hangs (as a stuck collective would)."""

import os
import time

print(f"PID {os.getpid()}", flush=True)
while True:
    time.sleep(1)
