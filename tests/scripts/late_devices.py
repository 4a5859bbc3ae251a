import json

import keras_distrib as kd

names = kd.virtual_devices(3)
import tensorflow as tf  # noqa: E402

tf.constant(1.0)  # initializes the devices
same_again = kd.virtual_devices(3)
try:
    kd.virtual_devices(2)
    late_error = ""
except RuntimeError as error:
    late_error = str(error)
print("RESULT " + json.dumps({"names": names, "same_again": same_again, "late_error": late_error}))
