"""Prints its pid, then waits; SIGTERM makes it exit 42, as a task that saved for a restart."""

import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(42))
print(f"PID {os.getpid()}", flush=True)
while True:
    time.sleep(1)
