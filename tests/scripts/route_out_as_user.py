"""An unprivileged user's private network with each route out: reached out, and reached by no one.

Usage (as the user; /dev/net/tun open to it): python tests/scripts/route_out_as_user.py

For slirp4netns, then pasta (slirp4netns not found, as where it is not
installed), makes a `PrivateNetwork` with a route out, and from inside it
(the user's namespaces, as a task joins them) connects to a server on this
host's loopback through `HOST_FROM_TASKS`, and listens on every interface
for 2 s while this process, in this host's network, tries that port on
loopback, twice (pasta's default would forward it after its look at the
bound ports, each second). Prints `RESULT {json}`: per route out, what it
was, what the inside read, and whether the port was reached from outside.
"""

import json
import socket
import subprocess
import sys
import threading
import time

from keras_distrib.cluster import network

INSIDE = """
import socket, sys, time
print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).recv(5).decode(), flush=True)
listener = socket.socket()
listener.bind(("0.0.0.0", 0))
listener.listen()
print(listener.getsockname()[1], flush=True)
time.sleep(3)
"""


def _serve(server):
    while True:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        with connection:
            connection.sendall(b"hello")


def _reachable(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def main():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    threading.Thread(target=_serve, args=(server,), daemon=True).start()
    report = {}
    for hidden in (None, network.SLIRP):
        if hidden:
            network.SLIRP = "kd-no-such-slirp4netns"
        made = network.PrivateNetwork(outbound=True)
        try:
            inside = subprocess.Popen(
                ["nsenter", "-t", str(made.pid), "-U", "-n", "--preserve-credentials", sys.executable,
                 "-c", INSIDE, network.HOST_FROM_TASKS, str(server.getsockname()[1])],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            read = inside.stdout.readline().strip()
            port = int(inside.stdout.readline())
            reached = [_reachable(port)]
            time.sleep(1.5)
            reached.append(_reachable(port))
            inside.wait(timeout=30)
            report[made.route_out] = {"read": read, "reached_from_outside": any(reached)}
        finally:
            made.close()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
