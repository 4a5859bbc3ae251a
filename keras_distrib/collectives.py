"""How many collectives a model's steps make: counted while TensorFlow traces them.

A collective (an all-reduce, an all-gather) is a barrier across every
replica and, between workers, a network round trip; its count per step is
what a cluster's latency multiplies. `count` runs one `fit`, `evaluate` and
`predict` step of a model on a batch that divides evenly over the replicas,
and counts the cross-replica reductions the strategy performs while the
step functions are traced, split by where they come from:

- `step`: inside the replica step (the gradients, row counts, loss
  denominators, BatchNormalization statistics);
- `logs`: reading the global metric values for the step's logs, once per
  compiled call (`steps_per_execution` steps).

The figure is deterministic: it depends on the model and strategy, not on
timing. Under a MirroredStrategy every reduction goes through
`StrategyExtended.reduce_to`/`batch_reduce_to`/`_gather_to`, which is
what is counted.
"""

import contextlib
import traceback

import tensorflow as tf

__all__ = [
    "count",
]

_REDUCTIONS = ("_reduce_to", "_batch_reduce_to", "_gather_to")
_LOGS = ("metric_results", "_global_values", "step_logs", "_extras", "reduce_mean")
_BUILD = ("symbolic_build", "build_from_data", "_symbolic_build")


@contextlib.contextmanager
def _counting(strategy, seen):
    extended = type(strategy.extended)
    originals = {name: getattr(extended, name) for name in _REDUCTIONS}

    def counted(name):
        original = originals[name]

        def reduction(self, *args, **kwargs):
            if tf.inside_function():
                # AutoGraph renames the functions it converts (tf__name).
                frames = {frame.name.removeprefix("tf__") for frame in traceback.extract_stack()}
                if not frames.intersection(_BUILD):
                    seen.append("logs" if frames.intersection(_LOGS) else "step")
            return original(self, *args, **kwargs)

        return reduction

    for name in _REDUCTIONS:
        setattr(extended, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(extended, name, original)


def count(model, x, y, *, sample_weight=None):
    """Collectives per `fit`, `evaluate` and `predict` step of `model` (compiled, in its strategy).

    `model`'s steps must not have been traced yet (what is counted is the
    tracing). `x`/`y` must be one global batch whose rows divide evenly over
    the replicas (so each step function is traced once). Trains one step.

    Returns:
        `{"train": {"step": n, "logs": m}, "test": {...}, "predict": {...}}`.

    Raises:
        ValueError: the model's strategy is not a MirroredStrategy, whose
            reductions this counts, or the rows do not divide evenly.
    """
    strategy = model.distribute_strategy
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        raise ValueError(
            f"`model` trains under {type(strategy).__name__}; `count` counts the reductions of "
            "a MirroredStrategy. Create the model under kd.make_strategy('mirrored')."
        )
    rows = len(tf.nest.flatten(x)[0])
    replicas = strategy.num_replicas_in_sync
    if rows == 0 or rows % replicas:
        raise ValueError(
            f"`x` has {rows} rows; expected a positive multiple of the {replicas} replicas, so "
            "that every step function is traced once. Pass one such global batch."
        )
    runs = {
        "train": lambda: model.fit(x, y, sample_weight=sample_weight, batch_size=rows, epochs=1,
                                   verbose=0, shuffle=False),
        "test": lambda: model.evaluate(x, y, sample_weight=sample_weight, batch_size=rows,
                                       verbose=0),
        "predict": lambda: model.predict(x, batch_size=rows, verbose=0),
    }
    counts = {}
    for kind, run in runs.items():
        seen = []
        with _counting(strategy, seen):
            run()
        counts[kind] = {"step": seen.count("step"), "logs": seen.count("logs")}
    return counts
