"""`keras-distrib test --gpu`'s checks on 2 logical CPU devices (the suite has no GPU)."""

import sys
import time

from keras_distrib.commands import selftest

started = time.monotonic()
code = selftest.main(gpu=True, device_type="CPU")
print(f"RESULT {{\"code\": {code}, \"seconds\": {time.monotonic() - started:.1f}}}")
sys.exit(code)
