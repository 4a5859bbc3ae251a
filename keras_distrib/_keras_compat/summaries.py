"""TensorBoard's model graphs: what Keras's TensorBoard callback writes.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import keras
from keras.src.callbacks import tensorboard as keras_tensorboard
from keras.src.models import functional as keras_functional

__all__ = [
    "write_model_config",
]


# The class names Keras's TensorBoard callback writes a `keras` summary for.
_KERAS_GRAPH_CLASSES = ("Functional", "Sequential")


def write_model_config(callback, model):
    """Writes the `keras` summary (TensorBoard's conceptual graph) Keras skips for `model`.

    Keras writes it only for models whose class is named `Functional` or
    `Sequential`; kd's functional class is `FunctionalModel`, and a user's
    subclass of a functional model has a name of its own. Any functional or
    sequential model whose config lists its layers gets it here; Keras's
    own ones already have it.
    """
    if type(model).__name__ in _KERAS_GRAPH_CLASSES:
        return False
    if not isinstance(model, (keras_functional.Functional, keras.Sequential)):
        return False
    try:
        layers = "layers" in model.get_config()
    except Exception:  # noqa: BLE001 - a model without a config has no conceptual graph
        return False
    if not layers:
        return False
    with callback._train_writer.as_default():
        return keras_tensorboard.keras_model_summary("keras", model, step=0)
