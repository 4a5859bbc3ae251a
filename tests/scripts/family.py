"""Starts a child and a daemon (double fork + setsid), prints the three pids, then `mode`.

`mode`: "hang" (sleeps; the launcher must stop it), "exit" (exits 0 at
once, leaving its child and daemon behind), "ignore" (ignores SIGTERM).
With a third argument "binary", also prints a line of bytes that are not UTF-8;
then `lines` more lines.
"""

import os
import signal
import subprocess
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "hang"
lines = int(sys.argv[2]) if len(sys.argv) > 2 else 0
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
read, write = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn daemon
        os.write(write, f"{os.getpid()}\n".encode())
        time.sleep(600)
    os._exit(0)
daemon = int(os.read(read, 64).decode().strip())
if sys.argv[3:] == ["binary"]:
    os.write(1, b"bytes \xff\xfe not utf-8\n")
for i in range(lines):
    print(f"line {i} " + "x" * 200)
print(f"FAMILY {os.getpid()} {child.pid} {daemon}", flush=True)
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode in ("hang", "ignore"):
    while True:
        time.sleep(1)
