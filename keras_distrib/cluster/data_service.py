"""A tf.data service beside the training tasks: one dispatcher and N data workers, as processes.

`keras-distrib launch --data-workers N` (`kd.launch(data_workers=N)`) runs
them with the training tasks, in the same private network, under the same
supervision: `task_specs` gives their `TaskSpec`s and the address the
training tasks find in `KD_DATA_SERVICE`. They are servers: their exit
does not end the run (a data worker that dies is reported; the dispatcher
hands the rest of the epoch to the others, and `kd.data.serve` computes in
the training workers what the dead one did not deliver), and they are
stopped when training ends.

On a cluster manager (Slurm, Kubernetes), start them yourself, one process
each, with this module:

    python -m keras_distrib.cluster.data_service dispatcher --port 5050
    python -m keras_distrib.cluster.data_service worker --dispatcher HOST:5050 [--host THIS_HOST]

and give the training tasks `KD_DATA_SERVICE=grpc://HOST:5050`.
"""

import argparse
import socket
import sys

from keras_distrib.cluster import ports as ports_lib
from keras_distrib.cluster import supervisor

__all__ = [
    "SERVICE_ENV",
    "serve_forever",
    "task_specs",
]

SERVICE_ENV = "KD_DATA_SERVICE"
DISPATCHER = "dispatcher"
DATA_WORKER = "data_worker"
# A data worker says it is alive this often, and the dispatcher gives up on
# one silent for WORKER_TIMEOUT_MS: then the job goes on without it (its
# unfinished splits are not served again: at most once).
HEARTBEAT_MS = 500
WORKER_TIMEOUT_MS = 3000


def task_specs(count, env):
    """`(specs, address)`: the dispatcher's and `count` data workers' `TaskSpec`s, and the service address.

    `env`: the training tasks' environment (their TF_CONFIG is dropped: the
    service's processes are not part of the TensorFlow cluster).
    """
    port = ports_lib.pick_ports(1)[0]
    base = {k: v for k, v in env.items() if k not in ("TF_CONFIG", "KD_TASK")}
    base["CUDA_VISIBLE_DEVICES"] = ""
    notes = {
        DISPATCHER: ("the training tasks' reads from the tf.data service fail from now on "
                     "(kd.data.serve names it)"),
        DATA_WORKER: ("the dispatcher gives the rest of the epoch to the other data workers, "
                      "and kd.data.serve computes what this one did not deliver in the "
                      "training workers"),
    }
    module = [sys.executable, "-u", "-P", "-m", "keras_distrib.cluster.data_service"]
    specs = [supervisor.TaskSpec(DISPATCHER, 0, [*module, "dispatcher", "--port", str(port)],
                                 dict(base, KD_TASK=f"{DISPATCHER} 0"), watched=False,
                                 exit_note=notes[DISPATCHER])]
    for index in range(count):
        specs.append(supervisor.TaskSpec(
            DATA_WORKER, index, [*module, "worker", "--dispatcher", f"localhost:{port}"],
            dict(base, KD_TASK=f"{DATA_WORKER} {index}"), watched=False,
            exit_note=notes[DATA_WORKER]))
    return specs, f"grpc://localhost:{port}"


def serve_forever(role, *, port=0, dispatcher=None, host=None):
    """Runs a dispatcher (`role="dispatcher"`) or a data worker until the process is stopped.

    A data worker tells the dispatcher its address as `host` (the training
    workers connect to it there): this machine's name by default, or
    localhost when the dispatcher runs on this machine too.
    """
    import tensorflow as tf

    if host is None:
        local = (dispatcher or "").rpartition(":")[0] in ("localhost", "127.0.0.1", "")
        host = "localhost" if local else socket.getfqdn()

    service = tf.data.experimental.service
    if role == "dispatcher":
        server = service.DispatchServer(service.DispatcherConfig(
            port=port, worker_timeout_ms=WORKER_TIMEOUT_MS))
    else:
        server = service.WorkerServer(service.WorkerConfig(
            dispatcher_address=dispatcher, worker_address=f"{host}:%port%", port=port,
            heartbeat_interval_ms=HEARTBEAT_MS))
    print(f"tf.data service {role} serving at {server.target if role == 'dispatcher' else dispatcher}",
          flush=True)
    server.join()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_distrib.cluster.data_service",
                                     description="Run a tf.data service dispatcher or data worker.")
    parser.add_argument("role", choices=["dispatcher", "worker"])
    parser.add_argument("--port", type=int, default=0, help="port to serve on (0: any free one)")
    parser.add_argument("--dispatcher", help="the dispatcher's HOST:PORT (for a worker)")
    parser.add_argument("--host", default=None,
                        help="a worker's address as the training workers reach it (default: "
                        "this machine's name; localhost when the dispatcher is on localhost)")
    options = parser.parse_args(argv)
    if options.role == "worker" and not options.dispatcher:
        parser.error("a worker needs --dispatcher HOST:PORT")
    serve_forever(options.role, port=options.port, dispatcher=options.dispatcher,
                  host=options.host)


if __name__ == "__main__":
    main()
