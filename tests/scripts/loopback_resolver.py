"""A host whose resolver listens on its own loopback (systemd-resolved's 127.0.0.53), as on Ubuntu.

Usage: unshare -m --propagation private python tests/scripts/loopback_resolver.py PRIVATE_NETWORK

PRIVATE_NETWORK: True, False, offline, or pasta: the default launch where
slirp4netns is absent (hidden as tests/scripts/users_machine.py hides it).

Run as root in a mount namespace of its own (it bind-mounts a resolv.conf
naming 127.0.0.53 over /etc/resolv.conf, seen by nothing outside): serves
DNS on 127.0.0.53:53 (every name is 192.0.2.77), checks that this process
resolves through it, then launches one task that resolves a name. Prints
`RESULT {json}`: what this host and the task resolved (or the error), and
the launch's network line.
"""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading

from keras_distrib.cluster import launcher

ANSWER = "192.0.2.77"


def serve(sock):
    while True:
        data, peer = sock.recvfrom(512)
        end = 12
        while data[end]:
            end += data[end] + 1
        question, qtype = data[12:end + 5], data[end + 1:end + 3]
        answers = 1 if qtype == b"\x00\x01" else 0  # A records only
        reply = data[:2] + b"\x81\x80" + struct.pack(">HHHH", 1, answers, 0, 0) + question
        if answers:
            reply += b"\xc0\x0c\x00\x01\x00\x01" + struct.pack(">IH", 60, 4) + socket.inet_aton(ANSWER)
        sock.sendto(reply, peer)


def main(private_network):
    if private_network == "pasta":
        for folder in ("", "/usr/local/bin", "/usr/bin", "/usr/sbin", "/sbin", "/bin"):
            found = shutil.which("slirp4netns", path=folder or None)
            if found:
                subprocess.run(["mount", "--bind", "/dev/null", os.path.realpath(found)], check=True)
        private_network = "auto"
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as conf:
        conf.write("nameserver 127.0.0.53\noptions edns0\n")
    subprocess.run(["mount", "--bind", conf.name, os.path.realpath("/etc/resolv.conf")], check=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.53", 53))
    threading.Thread(target=serve, args=(sock,), daemon=True).start()
    here = socket.gethostbyname("data.example.test")
    lines = []
    launcher.launch(os.path.join(os.path.dirname(os.path.abspath(__file__)), "resolve_name.py"),
                    workers=1, args=["data.example.test"], sink=lines.append, timeout=60,
                    private_network={"True": True, "False": False}.get(private_network, private_network))
    task = next((line.split("] ", 1)[1] for line in lines if "] RESOLVED " in line
                 or "] UNRESOLVED " in line), "\n".join(lines[-10:]))
    said = [line for line in lines if line.startswith("[launcher] network: ")]
    print("RESULT " + json.dumps({"host": here, "task": task, "network": said}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
