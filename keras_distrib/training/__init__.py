"""Training: one replica's step, the one outer loop, and what `fit` and `kd.TrainLoop` share.

From the bottom up: `replica` (a replica's batch), `penalties`, `losses`,
`gradients` (the loss and gradient arithmetic), `collectives`, `step` (the
one place that calls `strategy.run`), `data` (the input pipeline),
`loop` (the engine), `parameter_server` (a source and a runner), `inputs`
(what `fit`, `evaluate` and `predict` are given, checked), `front` (one
front door per verb), `models` (`kd.Model`), `callbacks` (`kd.callbacks`)
and `train_loop` (`kd.TrainLoop`). `tests/test_layers.py` keeps these
modules free of import circles.

May import: `checkpointing`, `cluster` and the floor (`validation`, `files`,
`tf_logs`, `keras_distrib._keras_compat`). Never `testing` or `commands`
(`tests/test_layout.py`).
"""
