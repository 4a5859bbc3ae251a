"""Training: one replica's step, the one outer loop, and what `fit` and `kd.TrainLoop` share.

From the bottom up (a module imports only those before it;
`tests/test_layout.py` keeps this order): `penalties` (what a tensor is to
the replica's rows, from one op table), `replica` (a replica's batch: its
rows, the global count), `scaling` (the global-batch scaling rule and its
arithmetic: a replica's fraction, deferred scale, the gradients'
correction), `coupling` (where the rows of a batch meet), `losses` (the
replica's share of the global loss), `logs` (metric states and the step's
logs), `batch_norm` (BatchNormalization's global moments), `draws` (random
draws for the global batch), `forward` (the forward pass on several
replicas as on one device: padding, where rows meet, layer state), `deferral`
(whether a step defers the scale), `buckets` (which gradients share an
all-reduce), `gradients` (the all-reduce before the optimizer), `hooks` (what kd installs
on a model's layers, optimizers and metrics),
`collectives` (counting them), `first_step` (the first step checked
against one device's), `step` (the one place that calls
`strategy.run`), `refusals` (what kd cannot make exact, named), `data` (the
input pipeline), `served` (input from tf.data service), `inputs` (what `fit`, `evaluate` and `predict` are given,
checked), `loop` (the engine), `parameter_server` (a source and a runner),
`front` (one front door per verb), `model_call` (a kd model's forward
pass in a replica), `model_files` (what a kd model's `save` writes),
`models` (`kd.Model`), `saving`,
`callbacks` (`kd.callbacks`) and `train_loop` (`kd.TrainLoop`).

May import: `checkpointing`, `cluster` and the floor (`validation`, `files`,
`tf_logs`, `keras_distrib._keras_compat`). Never `testing` or `commands`
(`tests/test_layout.py`).
"""
