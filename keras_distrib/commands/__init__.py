"""The command line (`keras-distrib ...`, `python -m keras_distrib ...`) and what it runs.

`cli` parses the commands; `demo`, `selftest` (`keras-distrib test`),
`environment` (`keras-distrib env`), `bench` and `bench_network`
(`keras-distrib bench`) are their bodies.

The top layer. May import: every other part of keras_distrib, including the
public package itself (`import keras_distrib as kd`); nothing imports it
except `keras_distrib.__main__` (`tests/test_layout.py`).
"""
