import sys

from keras_distrib.cli import main

sys.exit(main())
