"""Functions that tests run on launched clusters (importable by the tasks)."""

import os


def whoami(tag):
    from keras_distrib.cluster import info as cluster

    info = cluster.cluster_info()
    return {"tag": tag, "task": info.label, "chief": info.is_chief, "workers": info.num_workers, "pid": os.getpid()}


def command_lines(secret):
    """The task's command line and its parent's (the guard's), to check what `ps` shows."""
    def read(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()

    return {"own": read(os.getpid()), "parent": read(os.getppid()), "got": secret}


def listen_everywhere(seconds):
    """Listens on every interface (as TensorFlow's gRPC server does); returns the port after `seconds`."""
    import socket
    import time

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        print(f"LISTENING {port}", flush=True)
        time.sleep(seconds)
    return port


def crash(how):
    """Worker 1 prints a line and crashes in native code (`how`: segv, abort); the others wait."""
    import ctypes
    import time

    from keras_distrib.cluster import info as cluster

    if cluster.cluster_info().label != "worker 1":
        time.sleep(60)
        return None
    print("about to crash", flush=True)
    if how == "segv":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    os.abort()  # SIGABRT


def listen_and_reach_out(outside, seconds):
    """Listens on every interface (as TensorFlow's gRPC server does) and connects to `outside`.

    `outside`: [(host, port)] of servers outside the task's network; prints
    `REACHED host port <what it read>` or `UNREACHABLE host port <error>` for
    each, then keeps listening `seconds` (while the test tries to connect).
    """
    import socket
    import time

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        for host, outside_port in outside:
            try:
                with socket.create_connection((host, outside_port), timeout=5) as connection:
                    print(f"REACHED {host} {outside_port} {connection.recv(16).decode()}", flush=True)
            except OSError as error:
                print(f"UNREACHABLE {host} {outside_port} {error}", flush=True)
        print(f"LISTENING {port}", flush=True)
        time.sleep(seconds)
    return port


def fail_on(label, code):
    """The task `label` exits with `code` at once; the others wait for the launcher to stop them."""
    import time

    from keras_distrib.cluster import info as cluster

    if cluster.cluster_info().label == label:
        raise SystemExit(code)
    time.sleep(60)


def stop_self(label):
    """The task `label` stops itself (SIGSTOP) after its peers may have finished; others return."""
    import signal

    from keras_distrib.cluster import info as cluster

    if cluster.cluster_info().label == label:
        os.kill(os.getpid(), signal.SIGSTOP)
    return label


def leave_temporary_file():
    """Writes a file into the temporary directory, then dies by SIGKILL (nothing cleans up)."""
    import signal
    import tempfile

    handle, path = tempfile.mkstemp(prefix="left-by-a-killed-task-")
    os.close(handle)
    print(f"WROTE {path}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def fail_once(how, marker):
    """Fails the first time (`how`: "kill" itself with SIGKILL, or "exit" 1), succeeds after."""
    import signal

    if not os.path.exists(marker):
        open(marker, "w").close()
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(1)
    return how


def reach_out(host, port):
    """Connects to `host:port`, outside the task's network; a failure to connect ends the task."""
    import socket

    with socket.create_connection((host, port), timeout=5):
        pass
    return "REACHED"
