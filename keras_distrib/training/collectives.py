"""How many collectives a model's steps make: the collective ops TensorFlow traced.

A collective (an all-reduce, an all-gather) is a barrier across every
replica and, between workers, a network round trip; its count per step is
what a cluster's latency multiplies. What is counted is what TensorFlow
runs: the collective ops (`CollectiveReduceV2`, `CollectiveGatherV2`,
NCCL's, ...) in the graphs of a kd model's compiled step functions, the
functions they call included (the graph's function library, walked from
the top). Nothing kd requested is counted, only ops TensorFlow would run.

Each figure is per replica (a graph built for 2 in-process replicas holds
each collective twice). Ops inside the compiled loop of a call of several
steps (`steps_per_execution` > 1: the body of its `While`) run once per
step; ops outside it once per call. A call of one step runs everything
once per step.

Strategies that reduce without collective ops (central storage copies to
its parameter device and adds there) count 0: their cost is copies, not
barriers across processes.
"""

import tensorflow as tf


__all__ = [
    "count",
    "graph_collectives",
    "traced",
]

_KINDS = ("train", "test", "predict")
_NCCL = ("NcclAllReduce", "NcclReduce", "NcclBroadcast")
_LOOPS = ("While", "StatelessWhile")


def _is_collective(op):
    return op.startswith("Collective") or op in _NCCL


def graph_collectives(graph_def):
    """Collective ops in `graph_def` and every function it calls, by op type.

    Args:
        graph_def: A `tf.compat.v1.GraphDef` (e.g. a concrete function's
            `graph.as_graph_def()`), its function library included.

    Returns:
        `{"step": {op: n}, "call": {op: n}}`: `step` counts the ops inside a
        loop's body (a `While`'s `body`, and what it calls), which run once per
        iteration; `call` the others, which run once per call.
    """
    counts = {"step": {}, "call": {}}
    for node, in_loop in walk(graph_def.node, graph_def.library):
        if _is_collective(node.op):
            where = counts["step" if in_loop else "call"]
            where[node.op] = where.get(node.op, 0) + 1
    return counts


def walk(nodes, library):
    """`(node, in_loop)` for `nodes` and the nodes of every function they call, at each call.

    `library` is a graph's `FunctionDefLibrary`; `in_loop` says whether the
    node runs inside a loop's body (a `While`'s `body` or `cond`).
    """
    functions = {function.signature.name: function for function in library.function}

    def visit(nodes, in_loop):
        for node in nodes:
            yield node, in_loop
            for key, attr in node.attr.items():
                names = [attr.func.name] if attr.HasField("func") else []
                if attr.HasField("list"):
                    names += [function.name for function in attr.list.func]
                for name in names:
                    if name in functions:
                        body = node.op in _LOOPS and key in ("body", "cond")
                        yield from visit(functions[name].node_def, in_loop or body)

    return visit(nodes, False)


def _local_replicas(strategy):
    try:
        return max(len(strategy.extended.worker_devices), 1)
    except RuntimeError:  # the default strategy has no device list: one replica
        return 1


def _per_replica(ops, replicas):
    # Rounded up: an op made once per worker (the multi-worker iterator's)
    # is not hidden by several replicas in the process.
    return {op: -(-n // replicas) for op, n in sorted(ops.items())}


def _figures(functions, replicas, looped):
    """The largest count over `functions`' traces (each a variant of one call)."""
    best = {"step": {}, "call": {}}
    for concrete in functions:
        counts = graph_collectives(concrete.graph.as_graph_def())
        if not looped:  # one step per call: every op runs once per step
            counts = {"step": _merged(counts["step"], counts["call"]), "call": {}}
        if sum(map(sum, (c.values() for c in counts.values()))) >= sum(
            map(sum, (c.values() for c in best.values()))
        ):
            best = counts
    return {part: _per_replica(ops, replicas) for part, ops in best.items()}


def _merged(a, b):
    return {op: a.get(op, 0) + b.get(op, 0) for op in {*a, *b}}


def _step_functions(model, kind):
    """`{name: [ConcreteFunction]}` of `model`'s compiled `kind` step (`Step.compiled_functions`)."""
    step = getattr(model, f"{kind}_function", None)
    if not hasattr(step, "compiled_functions"):  # not traced yet, or not a kd model
        return {}
    return step.compiled_functions()


def traced(model):
    """Collectives per replica in the steps `model` has traced so far, by kind.

    Args:
        model: A kd model whose steps have run (`fit`, `evaluate`, `predict`).

    Returns:
        `{kind: {"step": n, "call": m, "read": r, "logs_each_call": b,
        "ops": {...}}}` for each of `"train"`, `"test"`, `"predict"` whose
        step function was traced: `n` collective ops run once per step, `m`
        once per compiled call outside its steps, `r` in the separate read of
        the logs (once per evaluation, when no callback looks at each call's
        logs); `b`: whether the calls counted return logs (False: an
        evaluation whose logs are read once, by that read); `ops` by op type.
    """
    replicas = _local_replicas(model.distribute_strategy)
    result = {}
    for kind in _KINDS:
        functions = _step_functions(model, kind)
        # The calls that return logs if traced, else those that read none.
        name = next((n for n in ("many", "one", "quiet_many", "quiet_one") if functions.get(n)), None)
        if name is None:
            continue
        figures = _figures(functions[name], replicas, looped=name.endswith("many"))
        read = _figures(functions.get("read", []), replicas, False)["step"]
        result[kind] = {
            "step": sum(figures["step"].values()),
            "call": sum(figures["call"].values()),
            "read": sum(read.values()),
            "logs_each_call": not name.startswith("quiet"),
            "ops": _merged(_merged(figures["step"], figures["call"]), read),
        }
    return result


def count(model, x, y, *, sample_weight=None, batch_size=None):
    """Collectives per replica in a `fit`, `evaluate` and `predict` of `model`.

    Runs one epoch of each on `x`/`y` (in `batch_size` batches, default: one
    batch of every row), then counts the collective ops in the graphs
    TensorFlow traced (see `traced`). `model`'s steps should not have been
    traced yet, or earlier traces are counted with them.

    Args:
        model: A compiled kd model (`kd.Model`, `kd.Sequential` or
            `kd.DistributedModelMixin`), built in its strategy's scope.
        x: Inputs for the epochs counted.
        y: Labels for them.
        sample_weight: Optional sample weights.
        batch_size: The global batch size; all of `x` in one batch when
            `None`.

    Returns:
        `traced(model)`.

    Raises:
        ValueError: `model` is not a kd model (its steps are not kd's `Step`s).
    """
    if not hasattr(model, "replica_batch"):
        raise ValueError(
            f"`model` is a {type(model).__name__}; `count` counts the steps of a kd model "
            "(kd.Model, kd.Sequential). Create it with keras_distrib's classes."
        )
    rows = len(tf.nest.flatten(x)[0])
    batch_size = batch_size or rows
    model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=1, verbose=0,
              shuffle=False)
    model.evaluate(x, y, sample_weight=sample_weight, batch_size=batch_size, verbose=0)
    model.predict(x, batch_size=batch_size, verbose=0)
    return traced(model)
