import sys

from keras_distrib.commands.cli import main

sys.exit(main())
