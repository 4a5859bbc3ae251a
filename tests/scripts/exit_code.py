"""Worker 1 fails with exit code 3; the others would run for a minute."""

import json
import os
import sys
import time

task = json.loads(os.environ["TF_CONFIG"])["task"]
print(f"PID {os.getpid()}", flush=True)
if task["index"] == 1:
    time.sleep(1.0)
    print("worker 1 giving up", flush=True)
    sys.exit(3)
time.sleep(60)
