"""Input pipelines served by tf.data service: preprocessing on other processes, epochs kd can state.

tf.data service runs a pipeline on data workers (other processes, other
machines) under a dispatcher; training workers read the elements over gRPC.
TensorFlow's own modes promise little a synchronous trainer can use:
`parallel_epochs` (OFF) serves every example once per data worker;
`distributed_epoch` (DYNAMIC) serves each example at most once, in the order
the data workers finish, and loses the splits of a data worker that dies;
static sharding (FILE, DATA, HINT) reads only from a data worker inside the
training process, and coordinated reads need that data worker to be remote:
TensorFlow refuses both at once.

`serve` builds the pipeline so that kd can say what each epoch is. Each
training worker has its own `distributed_epoch` job over the *slots* it
trains on: slot j is its replica r's piece of global batch k (j = k * L + r
for L local replicas), the same rows `kd.distribute_dataset` gives that
replica. The data workers turn a slot into rows (they run `preprocess`);
each element carries its slot, so the training worker knows what it holds:

- `mode="exact"`: elements are put back in slot order before the step
  reads them, so every replica trains on one device's global batches in
  one device's order, and the model is one device's.
- `mode="exactly_once"`: elements are trained on as they arrive (no
  waiting for a slow data worker); each example is still trained on once
  per epoch, but not in one device's order, nor in the same step as on one
  device.

In both, a slot the service does not deliver (its data worker died: the
at-most-once of `distributed_epoch`) is computed here, from the same
pipeline, and counted in `ServedDataset.recovered`; a slot that arrives
twice is used once. Every worker holds the same number of slots per epoch
(an empty piece where the last batch has too few rows), so every worker
takes every step.
"""

import dataclasses
import os
import queue as queue_lib
import socket
import threading
import time
import urllib.parse
import weakref

import numpy as np
import tensorflow as tf
from keras import tree

from keras_distrib import _keras_compat
from keras_distrib.cluster.data_service import SERVICE_ENV
from keras_distrib.training import data as data_lib
from keras_distrib.training import replica
from keras_distrib import validation

__all__ = [
    "MODES",
    "ServedDataset",
    "check_reachable",
    "description_of",
    "refuse_own_service_pipeline",
    "serve",
]

MODES = ("exact", "exactly_once")

# Slots held back, waiting for an earlier one, before that earlier one is
# computed here (it is late, or lost with its data worker): bounds the
# memory the reordering of `mode="exact"` takes.
REORDER_WINDOW = 64
# Pieces read from the service before the steps ask for them.
READ_AHEAD = 8

_described = weakref.WeakKeyDictionary()
_END = object()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which rows each of this worker's slots holds, per epoch.

    `starts[j]`, `counts[j]`: the rows of slot j in the examples (a count of
    0 is an empty piece of a last batch with fewer rows than replicas).
    """

    starts: np.ndarray
    counts: np.ndarray
    steps: int
    local: int


def slot_plan(examples, global_batch_size, *, replicas, workers, worker):
    """The rows of `worker`'s slots, as `kd.distribute_dataset` splits the global batches.

    Global batch k holds rows [k*B, min(k*B+B, N)); it is cut into pieces by
    `data.replica_split`, and worker w's local replica r takes piece
    r * W + w (`replica.piece_order`).
    """
    local = replicas // workers
    pieces = [replica.piece_order(replicas, workers)[worker * local + r] for r in range(local)]
    steps = -(-examples // global_batch_size)
    starts, counts = [], []
    for k in range(steps):
        first = k * global_batch_size
        rows = min(global_batch_size, examples - first)
        split = data_lib.replica_split(rows, replicas)
        offsets = np.concatenate([[0], np.cumsum(split)])
        for piece in pieces:
            starts.append(first + int(offsets[piece]))
            counts.append(int(split[piece]))
    return Plan(np.asarray(starts, np.int64), np.asarray(counts, np.int64), steps, local)


def check_reachable(service, timeout=30.0):
    """Raises ValueError when no dispatcher answers at `service` ("grpc://host:port") within `timeout` s.

    TensorFlow retries an unreachable dispatcher for a long time before it
    fails; a plain connection first says what is wrong. A dispatcher started
    with the training tasks may still be starting: refused connections are
    tried again until `timeout`.
    """
    parsed = urllib.parse.urlparse(service)
    if parsed.scheme != "grpc" or not parsed.hostname or not parsed.port:
        raise ValueError(
            f"`service`={service!r} is not a dispatcher address. Expected "
            "'grpc://HOST:PORT' (`keras-distrib launch --data-workers N` sets "
            f"{SERVICE_ENV} to it in every training task)."
        )
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout):
                return
        except OSError as error:
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise ValueError(
                f"`service`={service!r}: no tf.data service dispatcher answers at "
                f"{parsed.hostname}:{parsed.port} ({error}, for {timeout:g} s). Start one "
                "(`keras-distrib launch --data-workers N` starts a dispatcher and N data "
                "workers beside the training tasks), or check the address."
            ) from None


def _service_address(service):
    if service is None:
        service = os.environ.get(SERVICE_ENV)
        if not service:
            raise ValueError(
                f"`service` is None and {SERVICE_ENV} is not set: no tf.data service to read "
                "from. Pass `service='grpc://HOST:PORT'` (the dispatcher), or launch with "
                "`keras-distrib launch --data-workers N`, which starts one and sets "
                f"{SERVICE_ENV}."
            )
    if not isinstance(service, str):
        raise ValueError(f"`service`={service!r}: expected the dispatcher's address, "
                         "'grpc://HOST:PORT'")
    return service if "://" in service else f"grpc://{service}"


def _check(data, global_batch_size, mode, preprocess, strategy, timeouts):
    problems = []
    if mode not in MODES:
        problems.append(
            f"`mode`={mode!r}: expected 'exact' (one device's global batches, in order) or "
            "'exactly_once' (every example once per epoch, in the order the data workers "
            "deliver)"
        )
    if not validation.is_whole(global_batch_size, 1):
        problems.append(f"`global_batch_size`={global_batch_size!r}: expected a whole number >= 1")
    if preprocess is not None and not callable(preprocess):
        problems.append(f"`preprocess`={preprocess!r}: expected a function of one example, or None")
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        problems.append(f"`strategy`={strategy!r}: expected a tf.distribute.Strategy, or None")
    for name, value in timeouts.items():
        if not validation.is_seconds(value):
            problems.append(f"`{name}`={value!r}: expected a finite number of seconds > 0")
    leaves = tree.flatten(data) if not isinstance(data, tf.data.Dataset) else None
    if leaves is None or not leaves or not all(
            isinstance(v, np.ndarray) or tf.is_tensor(v) for v in leaves):
        problems.append(
            f"`data` is a {type(data).__name__}: expected NumPy arrays (or a tuple or dict of "
            "them) with one row per example. The data workers index rows by global batch, "
            "which a tf.data.Dataset cannot do without reading it from the start: put the "
            "expensive part in `preprocess` and pass what it starts from (file names, "
            "records, indices) as arrays. A pipeline of your own with "
            "`tf.data.experimental.service.distribute` is neither exact nor exactly-once "
            "under several training workers."
        )
    else:
        rows = {int(np.shape(v)[0]) if np.ndim(v) else -1 for v in leaves}
        if len(rows) != 1 or -1 in rows or 0 in rows:
            problems.append(f"`data`'s arrays have {sorted(rows)} rows: expected one row count "
                            ">= 1 for all of them")
    if problems:
        raise ValueError("Invalid kd.data.serve arguments:\n  - " + "\n  - ".join(problems))
    return int(np.shape(leaves[0])[0])


# Random ops whose draws depend on the order in which they run: a data worker
# draws them in whatever order its slots come, so a piece is not one device's.
_STATEFUL_RANDOM_OPS = {
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "RandomShuffle", "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial",
}


def _check_preprocess(dataset, mode):
    """Raises ValueError for a `preprocess` a data worker cannot run, or whose rows cannot be stacked.

    In `mode="exact"`, also for one that draws stateful random numbers: its
    result would depend on which data worker ran a slot, and when.
    """
    if _keras_compat.dataset_calls_python(dataset, _keras_compat.PYTHON_OPS):
        raise ValueError(
            "`preprocess` calls Python (tf.py_function / tf.numpy_function): the data workers "
            "run the pipeline's graph in other processes, without this process's Python "
            "functions, so the dataset cannot be served. Write it with TensorFlow ops only."
        )
    if mode == "exact" and _keras_compat.dataset_calls_python(dataset, _STATEFUL_RANDOM_OPS):
        raise ValueError(
            "`preprocess` draws stateful random numbers (tf.random.uniform, normal, shuffle, "
            "a tf.random.Generator...) and `mode`='exact': the draws depend on which data "
            "worker runs a slot and when, so the batches would not be one device's. Use "
            "stateless draws seeded by the example (tf.random.stateless_uniform(..., "
            "seed=...)), or mode='exactly_once'."
        )
    unknown = [spec for spec in tree.flatten(dataset.element_spec)
               if getattr(spec, "shape", None) is None or spec.shape.rank is None]
    if unknown:
        raise ValueError(
            f"`preprocess` returns tensors of unknown rank ({unknown}): the rows of a piece "
            "cannot be stacked. Give them a shape (tf.ensure_shape)."
        )


def _piece_fn(arrays, preprocess, example_spec):
    """slot rows (start, count) -> the piece: `preprocess` applied to each of its rows."""

    def piece(start, count):
        rows = tree.map_structure(lambda a: a[start:start + count], arrays)
        if preprocess is None:
            return rows
        return tf.map_fn(lambda row: preprocess(*row) if isinstance(row, tuple) else preprocess(row),
                         rows, fn_output_signature=example_spec)

    return piece


class ServedDataset:
    """The served input: what `serve` returns, and `fit` takes as `x`.

    `distributed` is the `tf.distribute.DistributedDataset` `fit` trains
    on; each iteration of it is one epoch of this worker's slots, read from
    the service. `recovered` counts the slots computed here because the
    service did not deliver them, `duplicates` those delivered twice.
    """

    def __init__(self, *, service, mode, examples, global_batch_size, arrays, preprocess,
                 strategy, stall_timeout):
        self.service = service
        self.stall_timeout = stall_timeout
        self.stalls = 0
        self.mode = mode
        self.examples = examples
        self.global_batch_size = global_batch_size
        self._arrays = arrays
        self._preprocess = preprocess
        self.plan = None
        self.recovered = 0
        self.duplicates = 0
        self._lock = threading.Lock()
        examples_dataset = tf.data.Dataset.from_tensor_slices(arrays)
        if preprocess is not None:
            examples_dataset = examples_dataset.map(preprocess)
            _check_preprocess(examples_dataset, mode)
        self._example_spec = examples_dataset.element_spec
        self.distributed = strategy.distribute_datasets_from_function(self._worker_dataset)
        _described[self.distributed] = self

    @property
    def steps(self):
        return -(-self.examples // self.global_batch_size)

    def description(self):
        """The line `fit` prints: where the input comes from and what an epoch is."""
        if self.mode == "exact":
            what = ("exact: one device's global batches in one device's order (each "
                    "worker puts its pieces back in order before the step)")
        else:
            what = ("exactly-once: every example once per epoch, trained on in the order the "
                    "data workers deliver (not one device's order)")
        return f"kd input: tf.data service at {self.service}, {what}; {self.steps} steps per epoch"

    def resumed_at(self, epoch, step):
        """Says what a resume at `step` of `epoch` (counted from 0) trains on; `fit` calls it.

        The steps the backup holds are read again and skipped. In slot order
        (`mode="exact"`) they are the same slots, so the rest of the epoch is
        one device's. In arrival order they are whichever slots come first
        this time: the epoch is no longer exactly-once, and kd says so.
        """
        if self.mode == "exact":
            print(f"kd.data.serve: resumed after {step} step(s) of epoch {epoch + 1} in slot order: "
                  "the rest of the epoch is one device's", flush=True)
            return
        print(f"kd.data.serve: resumed after {step} step(s) of epoch {epoch + 1} in "
              f"exactly-once mode: the {step} step(s) skipped are the first slots to arrive now, not those "
              "trained before the restart, so in this epoch some examples may be trained on "
              "twice and others not at all (later epochs are exactly-once again). Use "
              "mode='exact' for resumes that are exact.", flush=True)

    def _worker_dataset(self, input_context):
        """This worker's dataset: its slots, registered with the dispatcher, read per epoch."""
        self.plan = slot_plan(self.examples, self.global_batch_size,
                              replicas=input_context.num_replicas_in_sync,
                              workers=input_context.num_input_pipelines,
                              worker=input_context.input_pipeline_id)
        piece = _piece_fn(self._arrays, self._preprocess, self._example_spec)
        starts = tf.constant(self.plan.starts)
        counts = tf.constant(self.plan.counts)

        def slot_element(slot):
            return slot, piece(starts[slot], counts[slot])

        self._slot_dataset = tf.data.Dataset.range(len(self.plan.counts)).map(
            slot_element, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
        self._slot_element = slot_element
        try:
            self._dataset_id = tf.data.experimental.service.register_dataset(
                self.service, self._slot_dataset)
        except (tf.errors.OpError, ValueError, TypeError) as error:
            raise ValueError(
                f"The dispatcher at {self.service} could not register the served pipeline "
                f"({error}). Check that the data workers run this TensorFlow version, and "
                "that `preprocess` uses only TensorFlow ops (a data worker cannot run this "
                "process's Python functions)."
            ) from error
        batch_spec = tree.map_structure(
            lambda s: tf.TensorSpec([None, *s.shape], s.dtype), self._example_spec)
        dataset = tf.data.Dataset.from_generator(self._epoch, output_signature=batch_spec)
        return dataset.apply(tf.data.experimental.assert_cardinality(len(self.plan.counts)))

    def _read(self, stop):
        """One epoch's slots from the service, `(slot, piece)` in arrival order; stops at a stall.

        A data worker that dies mid-epoch leaves TensorFlow's reader waiting
        for the job to end, which it does not: the reading runs in a thread
        of its own, and when nothing arrives for `stall_timeout` seconds,
        the epoch goes on without the service (the caller computes the slots
        still missing).
        """
        # Bounded: the data workers run at most this far ahead of the steps.
        arrived = queue_lib.Queue(maxsize=READ_AHEAD)

        def put(item):
            while not stop.is_set():
                try:
                    arrived.put(item, timeout=0.5)
                    return True
                except queue_lib.Full:
                    continue
            return False

        def pump():
            try:
                served = tf.data.experimental.service.from_dataset_id(
                    processing_mode="distributed_epoch", service=self.service,
                    dataset_id=self._dataset_id, element_spec=self._slot_dataset.element_spec)
                for slot, piece in served:
                    if not put((int(slot), piece)):
                        return
                put(_END)
            except Exception as error:  # noqa: BLE001 - handed to the reading thread
                put(error)

        threading.Thread(target=pump, name="kd-served-read", daemon=True).start()
        while True:
            try:
                item = arrived.get(timeout=self.stall_timeout)
            except queue_lib.Empty:
                print(f"kd.data.serve: the tf.data service at {self.service} delivered nothing "
                      f"for {self.stall_timeout:g} s (a data worker lost?): this epoch's "
                      "remaining slots are computed in this worker", flush=True)
                with self._lock:
                    self.stalls += 1
                return
            if item is _END:
                return
            if isinstance(item, Exception):
                raise RuntimeError(
                    f"Reading from the tf.data service at {self.service} failed: {item}. Check "
                    "that its dispatcher runs (`keras-distrib launch --data-workers N` "
                    "starts one beside the training tasks)."
                ) from item
            yield item

    def _recover(self, slot):
        """A slot the service did not deliver (yet), computed here from the same pipeline."""
        with self._lock:
            self.recovered += 1
        return self._slot_element(tf.constant(slot, tf.int64))[1]

    def _epoch(self):
        """One epoch's pieces, each slot once (in slot order for `mode="exact"`)."""
        seen = set()
        waiting = {}
        want = 0
        total = len(self.plan.counts)
        exact = self.mode == "exact"

        def take(slot, piece):
            nonlocal want
            if slot in seen:
                with self._lock:
                    self.duplicates += 1
                return []
            seen.add(slot)
            if not exact:
                return [piece]
            waiting[slot] = piece
            out = []
            while want < total:
                if want in waiting:
                    out.append(waiting.pop(want))
                elif len(waiting) > REORDER_WINDOW:
                    # Late, or lost with its data worker: computed here.
                    seen.add(want)
                    out.append(self._recover(want))
                else:
                    break
                want += 1
            return out

        stop = threading.Event()
        try:
            for slot, piece in self._read(stop):
                yield from take(slot, piece)
                if len(seen) == total:
                    # Every slot is here: the job's end need not be waited for
                    # (with a data worker lost, it does not come).
                    break
        finally:
            stop.set()
        for slot in range(total):
            if slot not in seen:
                yield from take(slot, self._recover(slot))


def serve(data, *, global_batch_size, service=None, mode="exact", preprocess=None,
          strategy=None, connect_timeout=30.0, stall_timeout=60.0):
    """Serves `data`'s global batches from tf.data service, exact or exactly-once per epoch.

    The data workers (other processes; `keras-distrib launch --data-workers
    N` starts them) apply `preprocess` to every example; the training
    workers train on the results. What each epoch is (module docstring):

    - `mode="exact"`: one device's global batches, in one device's order
      (the model is one device's, as with `kd.distribute_dataset`).
    - `mode="exactly_once"`: every example once per epoch, trained on in
      the order the data workers deliver them.

    A data worker that dies mid-epoch loses nothing: the slots it did not
    deliver are computed in the training worker (`ServedDataset.recovered`).

    Args:
        data: NumPy arrays (or a tuple or dict of them), one row per example,
            in one device's order: what `preprocess` starts from (file names,
            records, raw features).
        global_batch_size: Examples per step over all replicas.
        service: The dispatcher, "grpc://HOST:PORT"; `None` reads
            `KD_DATA_SERVICE` (set by `keras-distrib launch --data-workers N`).
        mode: "exact" or "exactly_once".
        preprocess: A function of one example (as `Dataset.map`'s), run on
            the data workers; it must be deterministic for `mode="exact"`.
            `None`: the rows as they are.
        strategy: The strategy; the current one when `None`.
        connect_timeout: Seconds to wait for the dispatcher to answer
            (one started with the training tasks may still be starting).
        stall_timeout: Seconds without an element from the service after
            which the epoch's remaining slots are computed in the training
            worker (TensorFlow's reader waits for ever when a data worker
            dies mid-epoch). Longer than `preprocess` takes for one slot.

    Returns:
        A `ServedDataset`; pass it (or its `.distributed`) to `fit` as `x`.

    Raises:
        ValueError: a bad argument (every one named), no dispatcher at
            `service`, or a dataset the dispatcher cannot register.
    """
    examples = _check(data, global_batch_size, mode, preprocess, strategy,
                      dict(connect_timeout=connect_timeout, stall_timeout=stall_timeout))
    strategy = data_lib._strategy_or_current(strategy)
    data_lib._check_batch(global_batch_size, strategy.num_replicas_in_sync, False)
    service = _service_address(service)
    check_reachable(service, connect_timeout)
    arrays = tree.map_structure(tf.convert_to_tensor, data)
    return ServedDataset(service=service, mode=mode, examples=examples,
                         global_batch_size=global_batch_size, arrays=arrays,
                         preprocess=preprocess, strategy=strategy, stall_timeout=stall_timeout)


def refuse_own_service_pipeline(x):
    """Raises `InputError` when `x` is a dataset that reads from tf.data service outside `serve`.

    Such a pipeline's epochs are none of kd's: `parallel_epochs` repeats
    every example once per data worker, `distributed_epoch` serves each at
    most once in the data workers' order and waits for ever when one dies,
    and under several training workers the batches depend on which worker
    asked first. kd does not train on it silently.
    """
    if isinstance(x, tf.data.Dataset) and _keras_compat.reads_data_service(x):
        raise validation.InputError(
            "`x` reads from tf.data service (tf.data.experimental.service.distribute or "
            "from_dataset_id), whose epochs kd cannot state: each example once per data "
            "worker (parallel_epochs), or at most once in the data workers' order "
            "(distributed_epoch). Build it with kd.data.serve(arrays, global_batch_size=..., "
            "preprocess=..., mode='exact' or 'exactly_once'), which says what each epoch is "
            "(docs/guides/data-service.md)."
        )


def description_of(x):
    """The `ServedDataset` behind `x` (a `ServedDataset` or its `.distributed`), or None."""
    if isinstance(x, ServedDataset):
        return x
    try:
        return _described.get(x)
    except TypeError:
        return None
