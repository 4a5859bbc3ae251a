"""AutoGraph's conversion rules: kd's own code is called as written, like Keras's.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.

Inside a `tf.function`, AutoGraph rewrites every Python function the traced
code calls, recursively, unless a rule in
`tensorflow.python.autograph.core.config.CONVERSION_RULES` names its module:
TensorFlow, NumPy and Keras are left alone. kd was not, so a user's loop
that called `kd.losses.global_mean`, `kd.losses.scale_regularization` or a
kd model transpiled kd's graph walks and bookkeeping on every new trace
(about a third of the tracing time of the recipe's loop). kd's code builds
graphs with TensorFlow's own control flow and needs no rewriting; a
`tf.function` kd itself makes still converts its own body, as every
`tf.function` does (AutoGraph converts what the user asked for first).
"""

from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.autograph.core import config_lib as autograph_rules

__all__ = [
    "leave_unconverted",
]


def leave_unconverted(package="keras_distrib"):
    """Puts a do-not-convert rule for `package` first in AutoGraph's rules; returns whether it added one.

    Idempotent: a second call (a reload of kd) finds the rule and adds none.
    """
    rules = autograph_config.CONVERSION_RULES
    for rule in rules:
        if isinstance(rule, autograph_rules.DoNotConvert) and rule.matches(package):
            return False
    autograph_config.CONVERSION_RULES = (autograph_rules.DoNotConvert(package),) + tuple(rules)
    return True
