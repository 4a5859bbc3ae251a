# Moved to a package: the module's text is in `parity` until it is split.
from keras_distrib.testing.parity import *  # noqa: F401,F403
from keras_distrib.testing.parity import __all__  # noqa: F401
from keras_distrib.testing.parity import __doc__  # noqa: F401
from keras_distrib.testing.parity import pytest_addoption  # noqa: F401
from keras_distrib.testing.parity import pytest_configure  # noqa: F401
