"""What a script sees of its interpreter, for tests/test_harness.py.

Usage: interpreter_facts.py MODE [ARGS...]

Prints one 'RESULT {json}' line: argv, `__name__`, sys.path[0], the working
directory, the temporary directory, environment variables, its parent,
session and process group, whether TensorFlow's runtime was free to take a
device layout (2 virtual devices), then ends as MODE says: `exit N`
(sys.exit), `exit_text` (sys.exit with a message), `raise` (an uncaught
error), `interrupt` (an uncaught KeyboardInterrupt), `os_exit N` (os._exit
after the line), or `ok`. A thread it started prints when it ends, and an
atexit function after it: the end of the interpreter, which the warm child
does itself.
"""

import atexit
import json
import os
import sys
import tempfile
import threading
import time

import keras_distrib as kd

mode = sys.argv[1]
kd.virtual_devices(2)
import tensorflow as tf  # noqa: E402

facts = {
    "argv": sys.argv[1:],
    "name": __name__,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "reference_dir": os.environ.get("KD_REFERENCE_DIR"),
    "tempdir": tempfile.gettempdir(),
    "own_session": os.getsid(0) == os.getpid() == os.getpgid(0),
    "parent": os.getppid(),
    "probe": os.environ.get("KD_PROBE"),
    "devices": len(tf.config.list_logical_devices("CPU")),
    "stdin_is_a_tty": sys.stdin.isatty() if sys.stdin else None,
}
print("RESULT " + json.dumps(facts), flush=True)
print("to stderr", file=sys.stderr, flush=True)
# Not flushed: the interpreter's end flushes it.
atexit.register(lambda: print("atexit ran after the thread" if ended else "atexit ran first"))
ended = []
threading.Thread(target=lambda: (time.sleep(0.3), ended.append(True), print("thread ended"))).start()
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "exit_text":
    sys.exit("the script's own exit message")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "raise":
    raise RuntimeError("the script's own error")
if mode == "os_exit":
    os._exit(int(sys.argv[2]))
