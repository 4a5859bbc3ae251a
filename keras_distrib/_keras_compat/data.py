"""Keras's data adapters and epoch iterators, and tf.data/tf.distribute dataset internals.

Part of `keras_distrib._keras_compat`: only these modules touch `keras.src`,
`tensorflow.python` or private attributes of Keras/TensorFlow objects.
"""

import keras
import tensorflow as tf
from keras import tree
from tensorflow.python.distribute import input_lib
from tensorflow.python.framework import none_tensor
from keras.src.backend.common.symbolic_scope import in_symbolic_scope as _in_symbolic_scope
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.trainers.data_adapters import array_data_adapter
from keras.src.trainers.data_adapters import array_slicing
from keras.src.utils import python_utils

__all__ = [
    "agrees_on_batches",
    "autoconvert_optionals",
    "batches_from_arrays",
    "concat_predictions",
    "concat_replicas",
    "concrete_functions",
    "data_batch_size",
    "dataset_element_spec",
    "dataset_sources",
    "draw_order",
    "end_pass",
    "epoch_distributed_dataset",
    "epoch_iterator",
    "in_symbolic_scope",
    "is_absent_input_spec",
    "max_epochs",
    "next_epoch_over",
    "per_replica_specs",
    "pipeline_batch_size",
    "pythonify_logs",
    "reads_data_service",
    "redistributed",
    "serialized_graph",
    "set_epoch_batches",
    "skip_batch_agreement",
    "train_validation_split",
]


# The spec of an absent optional input: `tf.NoneTensorSpec` from TensorFlow
# 2.21; TensorFlow 2.20 has the class in tensorflow.python only.
_NONE_TENSOR_SPEC = getattr(tf, "NoneTensorSpec", none_tensor.NoneTensorSpec)


def is_absent_input_spec(spec):
    """Whether `spec` is an absent optional input's (`keras.Input(optional=True)` fed None)."""
    return isinstance(spec, (_NONE_TENSOR_SPEC, tf.OptionalSpec))


def epoch_iterator(**kwargs):
    """Keras's epoch iterator for TensorFlow (its data adapters, chunking); see `_EpochIterator`."""
    return _EpochIterator(**kwargs)


class _EpochIterator(keras_tf_trainer.TFEpochIterator):
    """Keras's TFEpochIterator, without the distributed iterator it opens and never uses.

    When a pass has run its known batch count, Keras opens an iterator for
    the next epoch; without `steps_per_epoch` the next epoch opens its own
    and that one is dropped unused (`iterators_before_epoch`). Opening a
    distributed iterator traces six TensorFlow functions per device (about
    60 ms for 2 CPU devices, 130 ms for 4). What the unused one changes is
    the seed state of a dataset that reshuffles each iteration: its opening
    draws an order, and the next epoch trains on the order after it. Here
    that opening is each worker's plain tf.data iterator over the same
    dataset, which draws the same order and traces nothing, so every
    epoch's batches stay those of Keras on one device.
    """

    _pass_ended = False

    def _enumerate_iterator(self):
        chunks = super()._enumerate_iterator()
        started = False
        try:
            while True:
                # Keras opens the next epoch's iterator only once a chunk of
                # this pass has run; before that, `_steps_seen` may still
                # count an earlier pass.
                self._pass_ended = (
                    started and self.steps_per_epoch is None and bool(self._num_batches)
                    and self._steps_seen >= self._num_batches
                )
                try:
                    chunk = next(chunks)
                except StopIteration:
                    return
                finally:
                    self._pass_ended = False
                started = True
                yield chunk
        finally:
            chunks.close()

    def _get_iterator(self):
        distributed = super()._get_iterator()
        if self._pass_ended and type(distributed) is input_lib.DistributedDataset:
            return _OrderDraw(distributed)
        return distributed


class _OrderDraw:
    """Iterating it opens and drops each worker's plain iterator over a distributed dataset.

    It stands where Keras keeps an iterator it never reads; reading it is a
    kd bug, and says so rather than train on other batches.
    """

    def __init__(self, distributed):
        self._distributed = distributed

    def __iter__(self):
        draw_order(self._distributed)
        return self

    def __next__(self):
        raise RuntimeError(
            "keras_distrib: Keras read the iterator it opens at the end of a pass, which kd "
            "replaces because Keras never reads it (keras_distrib/_keras_compat/data.py). "
            "This Keras version changed that: please report it with your Keras version."
        )

    get_next = get_next_as_optional = __next__


def draw_order(dataset):
    """Opens and drops an iterator over `dataset`: one that reshuffles each iteration draws its next order.

    For a distributed dataset, each input worker's plain tf.data iterator
    over its dataset: it draws the same order as a distributed iterator,
    which would trace six TensorFlow functions per device.
    """
    if type(dataset) is input_lib.DistributedDataset:
        for worker, part in zip(dataset._input_workers.worker_devices, dataset._cloned_datasets):
            with tf.device(worker):
                iter(part)
    else:
        iter(dataset)


def skip_batch_agreement(epoch_iterator):
    """Makes the iterators of an epoch iterator's distributed dataset fetch without agreeing.

    Across workers, TensorFlow's distributed iterator all-reduces at every
    batch whether any worker still has one (to hand empty batches to those
    that ran out). Where every worker holds the same known number of
    batches, one per replica, none runs out first: the caller checks that.
    """
    epoch_iterator._distributed_dataset._enable_get_next_as_optional = False


def batches_from_arrays(epoch_iterator):
    """Whether Keras made an epoch iterator's dataset from in-memory arrays (`ArrayDataAdapter`).

    Such a dataset is sharded across workers by data: TensorFlow splits every
    global batch into one batch per replica (empty ones included), so every
    worker holds as many batches as the global dataset, one per replica.
    """
    return isinstance(getattr(epoch_iterator, "data_adapter", None),
                      array_data_adapter.ArrayDataAdapter)


def agrees_on_batches(iterator):
    """Whether a distributed iterator all-reduces "any batch left?" at each fetch."""
    return getattr(iterator, "_enable_get_next_as_optional", True) is not False


def set_epoch_batches(epoch_iterator, count):
    """Makes a Keras epoch iterator run `count` steps per epoch (None: until the data ends).

    Unlike `steps_per_epoch`, a fresh iterator over the data still starts
    every epoch; the count survives `reset()`.
    """
    reset = type(epoch_iterator).reset.__get__(epoch_iterator)

    def counted_reset():
        reset()
        epoch_iterator._num_batches = count

    object.__setattr__(epoch_iterator, "reset", counted_reset)
    epoch_iterator._num_batches = count
def data_batch_size(epoch_iterator):
    """The global batch size of a Keras epoch iterator's data, or None where not known.

    A `tf.data` pipeline whose batches have no static size (`filter`, a
    last batch kept) is read through its transformations to its `batch`.
    """
    adapter = getattr(epoch_iterator, "data_adapter", None)
    try:
        size = getattr(adapter, "batch_size", None)
    except Exception:  # noqa: BLE001 - an adapter may not know it
        return None
    if size is None and isinstance(getattr(adapter, "_dataset", None), tf.data.Dataset):
        size = pipeline_batch_size(adapter._dataset)
    return int(size) if isinstance(size, int) and size > 0 else None


# Transformations after which a `batch` further up no longer sets the rows per element.
_REBATCHING = ("Unbatch", "Rebatch", "FlatMap", "Interleave", "Window", "GroupBy", "Bucket",
               "Scan", "Choose", "Sample", "Zip", "Concatenate")


def pipeline_batch_size(dataset):
    """The `batch_size` of the `batch` that makes `dataset`'s elements, or None.

    Walks the pipeline from its end through transformations that keep each
    element's rows (map, filter, prefetch, cache, take, skip, shuffle,
    repeat...). TensorFlow's private `_input_dataset` / `_batch_size`.
    """
    while isinstance(dataset, tf.data.Dataset):
        name = type(dataset).__name__
        if any(word in name for word in _REBATCHING):
            return None
        if "Batch" in name and hasattr(dataset, "_batch_size"):
            value = tf.get_static_value(dataset._batch_size)
            return int(value) if value is not None and int(value) > 0 else None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


def dataset_sources(dataset):
    """Yields `dataset` and every `tf.data.Dataset` it reads, each once.

    Walks TensorFlow's private `_inputs()`; a dataset that cannot name its
    inputs raises (NotImplementedError), so that no question about the
    whole pipeline is answered from part of it.
    """
    pending, seen = [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen or not isinstance(current, tf.data.Dataset):
            continue
        seen.add(id(current))
        yield current
        pending.extend(current._inputs())


def reads_data_service(dataset):
    """Whether a `tf.data.Dataset` reads from tf.data service (`service.distribute`, `from_dataset_id`).

    Walks the dataset's inputs (`dataset_sources`) to a `_DataServiceDataset`.
    """
    return any("DataService" in type(current).__name__ for current in dataset_sources(dataset))


def dataset_element_spec(epoch_iterator):
    """The element spec of a Keras TFEpochIterator's dataset, without iterating.

    Opening an iterator would consume (and for a reshuffling dataset,
    reorder) the user's data; building the model needs only shapes.
    """
    return epoch_iterator._distributed_dataset.element_spec


def end_pass(epoch_iterator):
    """Ends a Keras epoch iterator's pass over its data, whether or not the data ran out.

    Keras keeps the pass as a generator whose frame holds the epoch iterator
    that holds the generator. A pass left before the data ran out (a
    callback's `stop_training`, an error) is a reference cycle that keeps
    the pass's tf.data iterators alive, with their threads, until a full
    garbage collection. Freeing them there stalled the collecting thread
    for up to 40 s: the iterator's destructor waits for its autotuning
    thread, whose sleep grows the longer the iterator lives. Closing the
    generator breaks the cycle. A finished pass has nothing to close.
    Sources that are not Keras epoch iterators are left as they are.
    """
    if isinstance(epoch_iterator, keras_tf_trainer.TFEpochIterator):
        generator = epoch_iterator._epoch_iterator
        if generator is not None:
            generator.close()


def epoch_distributed_dataset(epoch_iterator):
    """The distributed dataset a Keras TFEpochIterator iterates, or None for other sources."""
    if not isinstance(epoch_iterator, keras_tf_trainer.TFEpochIterator):
        return None
    return epoch_iterator._distributed_dataset


def redistributed(distributed, transform):
    """`distributed`'s dataset changed by `transform`, distributed the same way; or None.

    For a dataset `experimental_distribute_dataset` made (not one from a
    `dataset_fn`): the same strategy and `tf.distribute.InputOptions`, over
    `transform(dataset)`, the batched dataset before it was split. The
    default strategy distributes a dataset as it is: `transform(dataset)`.
    """
    if isinstance(distributed, tf.data.Dataset):  # the default strategy's, not split
        return transform(distributed)
    if type(distributed) is not input_lib.DistributedDataset:
        return None
    dataset = getattr(distributed, "_original_dataset", None)
    if dataset is None:
        return None
    return distributed._strategy.experimental_distribute_dataset(
        transform(dataset), options=distributed._options)


def next_epoch_over(epoch_iterator, distributed):
    """Makes a Keras TFEpochIterator's next fresh iterator come from `distributed`.

    Once: later epochs iterate its own distributed dataset again. Returns
    False (nothing changed) where the epoch goes on from an iterator already
    open (`steps_per_epoch` over an earlier epoch's iterator).
    """
    if epoch_iterator._current_iterator is not None:
        return False

    def once():
        del epoch_iterator._get_iterator  # back to the class's method
        return distributed

    object.__setattr__(epoch_iterator, "_get_iterator", once)
    return True


def per_replica_specs(spec):
    """The per-replica element specs of a distributed element spec, or None."""
    return getattr(spec, "_value_specs", None)


def autoconvert_optionals(data):
    """Keras feeds `tf.experimental.Optional` for absent parts; map to None."""
    return tree.map_structure(
        lambda x: None if isinstance(x, tf.experimental.Optional) else x, data
    )


def concat_replicas(outputs, strategy):
    """Per-replica outputs concatenated in replica (input) order, over workers too."""
    return keras_tf_trainer.reduce_per_replica(outputs, strategy, reduction="concat")


def concat_predictions(batches):
    """Keras's `predict` result from each call's outputs, in order.

    NumPy arrays, or a RaggedTensor (or SparseTensor) where the outputs are
    ragged, or their shapes differ from batch to batch, as Keras returns.
    """
    first = batches[0]
    lists = tree.map_structure(lambda _: [], first)
    for batch in batches:
        tree.map_structure_up_to(first, lambda parts, value: parts.append(value), lists, batch)
    joined = tree.map_structure_up_to(first, keras_tf_trainer.potentially_ragged_concat, lists)
    return tree.map_structure(keras_tf_trainer.convert_to_np_if_not_ragged, joined)


def pythonify_logs(logs):
    """Keras's logs as Python numbers, as `fit` returns them."""
    return python_utils.pythonify_logs(logs)


def train_validation_split(arrays, validation_split):
    """Keras's split of arrays for `validation_split`: (train, validation)."""
    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def max_epochs():
    """Keras's `max_epochs` setting (`keras.config.max_epochs()`)."""
    return keras.config.max_epochs()


def in_symbolic_scope():
    """Whether Keras is tracing symbolically (building a functional model)."""
    return _in_symbolic_scope()


def serialized_graph(dataset):
    """A dataset's serialized GraphDef (to count the files it reads)."""
    return dataset._as_serialized_graph()


def concrete_functions(function):
    """Every `ConcreteFunction` a `tf.function` has traced (to count its ops)."""
    return list(function._list_all_concrete_functions())
