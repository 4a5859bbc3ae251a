"""TensorFlow's C++ start-up notices: hidden by default, one switch to see them.

Every TensorFlow 2.21 process prints the same notices when it starts: oneDNN
is on, no CUDA driver was found, which CPU instructions the binary was built
for, and (on a machine without a GPU) an `E0000 ... failed call to cuInit`
that is not an error at all. Several are printed before TensorFlow's logging
reads `TF_CPP_MIN_LOG_LEVEL`, so that variable cannot hide them
(tensorflow/tensorflow#100442). Repeated by every task of a cluster, they
bury the lines that matter.

The rule, in one place: unless `TF_CPP_MIN_LOG_LEVEL` is 0 or 1, kd drops
those known notices (`is_startup_notice`) where it can see them: while
keras_distrib imports TensorFlow, while `kd.virtual_devices` and
`kd.local_cluster` start the devices, and in the output `kd.launch` relays
from its tasks. Every other line, real errors included, passes. kd's own
command line (`keras-distrib ...`) and the tasks it launches also run with
`TF_CPP_MIN_LOG_LEVEL=2` (TensorFlow's INFO and WARNING lines off) unless the
variable is set; `--verbose` sets it to 0 and shows everything.

This module imports nothing heavy: keras_distrib's `__init__` uses it
before TensorFlow is imported.
"""

import contextlib
import os
import re
import sys
import tempfile
import time

__all__ = [
    "configure_command_line",
    "hidden_notices",
    "hides_notices",
    "import_tensorflow",
    "is_command_line",
    "is_startup_notice",
    "task_environment",
]

STARTED = time.monotonic()  # keras_distrib imports this module first: its start-up begins here

LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
set_by_command_line = False  # whether configure_command_line set the level
QUIET_LEVEL = "2"
VERBOSE_LEVEL = "0"

# The notices TensorFlow prints at every start, by the source file that
# prints them (glog format: `I0000 00:00:1795.123 4242 port.cc:153] ...`).
_NOTICES = (
    ("port.cc", "oneDNN custom operations are on"),
    ("cudart_stub.cc", "Could not find cuda drivers"),
    ("cpu_feature_guard.cc", "This TensorFlow binary is optimized"),
    ("cuda_platform.cc", "failed call to cuInit"),
    ("cuda_fft.cc", "Unable to register cuFFT factory"),
    ("cuda_dnn.cc", "Unable to register cuDNN factory"),
    ("cuda_blas.cc", "Unable to register cuBLAS factory"),
    ("computation_placer.cc", "computation placer already registered"),
)
_GLOG = re.compile(r"^[IWEF]\d{4} [\d:. ]+\s+\d+ ([\w.]+):\d+\] (.*)$")
_PLAIN = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    # The second line of cpu_feature_guard.cc's notice.
    "To enable the following instructions:",
)


def is_startup_notice(line):
    """Whether `line` is one of TensorFlow's known start-up notices.

    Examples:
        >>> is_startup_notice("I0000 00:00:1795439466.604094   18429 port.cc:153] "
        ...                   "oneDNN custom operations are on. You may see ...")
        True
        >>> is_startup_notice("E0000 00:00:1.2 42 collective_ops.cc:9] Collective failed")
        False
    """
    line = line.rstrip("\n")
    if line.startswith(_PLAIN):
        return True
    match = _GLOG.match(line)
    if match is None:
        return False
    source, message = match.groups()
    return any(source == file and message.startswith(text) for file, text in _NOTICES)


def hides_notices(env=None):
    """Whether the notices are hidden for a process with environment `env`.

    They are, unless `TF_CPP_MIN_LOG_LEVEL` asks for INFO lines (0 or 1).
    """
    env = os.environ if env is None else env
    return env.get(LEVEL_VARIABLE, "").strip() not in ("0", "1")


def task_environment(env, *, verbose=False):
    """`env` for a task kd starts: TensorFlow's level 2, or 0 when `verbose`.

    A level the user set is kept either way.
    """
    env = dict(env)
    env.setdefault(LEVEL_VARIABLE, VERBOSE_LEVEL if verbose else QUIET_LEVEL)
    return env


def is_command_line(argv=None, orig_argv=None):
    """Whether this process is kd's command line (`keras-distrib`, `python -m keras_distrib`)."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    if argv and os.path.basename(argv[0]) == "keras-distrib":
        return True
    for index, value in enumerate(orig_argv):
        if value == "-m" and index + 1 < len(orig_argv):
            return orig_argv[index + 1] == "keras_distrib"
        if value == "-mkeras_distrib":
            return True
    return False


def configure_command_line(env=None, argv=None, orig_argv=None):
    """Sets `TF_CPP_MIN_LOG_LEVEL` for kd's command line, before TensorFlow loads.

    TensorFlow reads the variable once, when it starts, and the command's
    subprocesses inherit it; a value the user set is kept.
    """
    global set_by_command_line
    env = os.environ if env is None else env
    if not is_command_line(argv, orig_argv) or LEVEL_VARIABLE in env:
        return
    verbose = "--verbose" in (sys.argv if argv is None else argv)
    env[LEVEL_VARIABLE] = VERBOSE_LEVEL if verbose else QUIET_LEVEL
    set_by_command_line = set_by_command_line or env is os.environ


def import_tensorflow():
    """Imports TensorFlow (if no one did yet) without its start-up notices."""
    if "tensorflow" in sys.modules:
        return
    with hidden_notices():
        import tensorflow  # noqa: F401


@contextlib.contextmanager
def hidden_notices(stream_fd=2):
    """Drops TensorFlow's start-up notices written to `stream_fd` inside the block.

    TensorFlow writes them from C++ straight to file descriptor 2, past
    Python's `sys.stderr`, so the descriptor itself is redirected to a
    temporary file; when the block ends, every other line is written back,
    in order. Does nothing when `hides_notices()` is false.
    """
    if not hides_notices():
        yield
        return
    try:
        saved = os.dup(stream_fd)
    except OSError:  # no such descriptor (e.g. some embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as capture:
        try:
            sys.stderr.flush()
        except (AttributeError, ValueError):
            pass
        os.dup2(capture.fileno(), stream_fd)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (AttributeError, ValueError):
                pass
            os.dup2(saved, stream_fd)
            os.close(saved)
            capture.seek(0)
            kept = [
                line for line in capture.read().decode("utf-8", "replace").splitlines(keepends=True)
                if not is_startup_notice(line)
            ]
            if kept:
                os.write(stream_fd, "".join(kept).encode("utf-8"))
