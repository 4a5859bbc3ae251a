"""kd.local_cluster: the parameter-server coordinator flow in one process."""

import runpy
import sys

sys.argv = [sys.argv[0], "local"]
runpy.run_path(__file__.replace("local_ps.py", "ps_coordinator.py"), run_name="__main__")
