"""Checkpoints on disk: `checkpoint` (`kd.CheckpointManager`, backup and progress files) and
`evaluator` (`kd.SidecarEvaluator`, which follows a training run's checkpoints).

They know files, the cluster's chief and `tf.train.Checkpoint`, not models or the
training loop: the callbacks that write checkpoints during `fit` live in
`keras_distrib.training.callbacks`.

May import: `cluster` and the floor (`validation`, `files`, `tf_logs`,
`keras_distrib._keras_compat`). Never `training`, `testing` or `commands`
(`tests/test_layout.py`).
"""
