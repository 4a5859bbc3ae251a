"""Prints `RESOLVED <address>` for the name in argv[1], or `UNRESOLVED <error>`."""

import socket
import sys

try:
    print("RESOLVED", socket.gethostbyname(sys.argv[1]), flush=True)
except OSError as error:
    print("UNRESOLVED", error, flush=True)
