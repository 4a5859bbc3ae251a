"""What a launched task runs: a user function, or a parameter-server server.

`python -P -m keras_distrib.cluster._task_entry --function mod:fn --values DIR`
calls `mod.fn(*ARGS)`, ARGS read from the pickle `DIR/args.pickle` (in the
launch's private scratch directory, mode 0700: never on the command line,
where any local user reads it with `ps`), and stores the return value for
the launcher; `--server` starts a `tf.distribute.Server` for this task's
TF_CONFIG and blocks. `-P` keeps the task's working directory off `sys.path`
(a `tensorflow.py` there must not run in the tasks); the launcher's own
`sys.path` is put first, so the function resolves as it did there.
"""

import argparse
import importlib
import os
import pickle
import signal
import socket
import sys
import time


def function_spec(target):
    """`"module:qualname"` for an importable function (or that string)."""
    if isinstance(target, str):
        module, _, name = target.partition(":")
        if not module or not name:
            raise ValueError(
                f"`target`={target!r}: expected 'package.module:function'."
            )
        return target
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None)
    if not callable(target) or not module or not name or "<" in name:
        raise ValueError(
            f"`target`={target!r} is not an importable function. Define it at "
            "module level in a .py file (from a notebook: write the file with "
            "%%writefile, then import it)."
        )
    if module == "__main__":
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        if not path:
            raise ValueError(
                f"`target`={name} is defined in an interactive session, which "
                "other processes cannot import. Put it in a .py module."
            )
        module = os.path.splitext(os.path.basename(path))[0]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    return f"{module}:{name}"


ARGS_FILE = "args.pickle"
# `python -P -m`: the working directory is not put first on sys.path.
PYTHON_MODULE = [sys.executable, "-u", "-P", "-m"]


def argv_factory(spec, args, values_dir):
    fd = os.open(os.path.join(values_dir, ARGS_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        pickle.dump(tuple(args), f)
    entries = [p for p in sys.path if p]
    if "" in sys.path:
        # A notebook or `python -c` finds modules in its working directory
        # (the '' entry). Tasks start with -P, so the working directory is not
        # searched first; only the target's own module is found there, last.
        top = spec.partition(":")[0].split(".")[0]
        here = os.path.abspath(os.getcwd())
        if os.path.isfile(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top)):
            entries.append(here)
    path_entries = os.pathsep.join(entries)

    def argv_for(task_type, task_index):
        return [
            *PYTHON_MODULE, "keras_distrib.cluster._task_entry",
            "--function", spec, "--values", values_dir, "--path", path_entries,
        ]

    return argv_for


def collect_values(values_dir):
    values = {}
    for name in sorted(os.listdir(values_dir)):
        if name == ARGS_FILE or name.startswith("."):
            continue
        with open(os.path.join(values_dir, name), "rb") as f:
            values[name.replace("_", " ")] = pickle.load(f)
    return values


def _resolve(spec):
    module_name, _, qualname = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _run_function(spec, values_dir):
    with open(os.path.join(values_dir, ARGS_FILE), "rb") as f:
        args = pickle.load(f)
    value = _resolve(spec)(*args)
    task = os.environ.get("KD_TASK", "worker 0").replace(" ", "_")
    tmp = os.path.join(values_dir, f".{task}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, os.path.join(values_dir, task))


def _run_server():
    import tensorflow as tf

    from keras_distrib.cluster import info as cluster

    info = cluster.cluster_info()
    resolver = (cluster.cluster_resolver(info)
                or tf.distribute.cluster_resolver.TFConfigClusterResolver())
    # Two inter-op threads are not enough on a 2-core machine: the server
    # deadlocks while a worker waits on a ps (see FINDINGS).
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=info.task_type,
        task_index=info.task_index,
        protocol=resolver.rpc_layer or "grpc",
        config=config,
        start=True,
    )
    print(f"{info.label} server listening (pid {os.getpid()})", flush=True)

    def keep_serving(signum, frame):
        # A preemption reaches every task at once (srun, Kubernetes, the
        # launcher), but the coordinator's final backup reads the variables
        # from this server: serve on until the grace period's SIGKILL.
        print(f"{info.label} server got {signal.Signals(signum).name}; serving on so that the "
              "coordinator can save its backup (SIGKILL stops it)", flush=True)

    signal.signal(signal.SIGTERM, keep_serving)
    # Not server.join(), which blocks signal handlers: wait here, and end
    # when the coordinator is gone. On a node whose agent runs only servers
    # (srun or a Kubernetes Job) nothing else would ever stop them.
    chief = (info.cluster.get("chief") or [None])[0]
    seen, gone_since = False, None
    while True:
        time.sleep(COORDINATOR_POLL_SECONDS)
        if chief is None:
            continue
        if _accepts_connections(chief):
            if not seen:
                print(f"{info.label} server: the coordinator (chief 0 at {chief}) is up; this "
                      "server ends once it is gone", flush=True)
            seen, gone_since = True, None
            continue
        if not seen:
            continue  # the coordinator has not started yet
        gone_since = gone_since or time.monotonic()
        if time.monotonic() - gone_since >= COORDINATOR_GONE_SECONDS:
            print(f"{info.label} server: the coordinator (chief 0 at {chief}) has not accepted "
                  f"connections for {COORDINATOR_GONE_SECONDS:g}s, so training ended or it died "
                  "(its node's launcher says which); this server exits. After a failure, "
                  "restart the job (keras-distrib launch --max-restarts K); training resumes "
                  "from its backup.", flush=True)
            return


COORDINATOR_POLL_SECONDS = 0.5
COORDINATOR_GONE_SECONDS = 10.0


def _accepts_connections(address):
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(prog="keras_distrib.cluster._task_entry")
    parser.add_argument("--server", action="store_true")
    parser.add_argument("--function")
    parser.add_argument("--values")
    parser.add_argument("--path", default="")
    options = parser.parse_args(argv)
    if options.server:
        return _run_server()
    # The launcher's sys.path, in its order: the function resolves as it did there.
    for entry in reversed(options.path.split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    _run_function(options.function, options.values)


if __name__ == "__main__":
    main()
