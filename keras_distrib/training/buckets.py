"""Gradient buckets: which gradients share an all-reduce, so communication overlaps the backward pass.

kd sums the replicas' gradients before the optimizer (`gradients.all_reduce`).
Where latency dominates (small models, replicas in one process, a fast
link), one all-reduce of every gradient is the cheapest step: one barrier,
one round trip's worth of latency. Where bandwidth dominates (a large
gradient over a network between workers), a step that all-reduces after
the backward pass pays compute + communication; gradients split into
buckets, each summed as soon as the backward pass has produced it, let a
step tend to max(compute, communication).

The backward pass produces the last layers' gradients first, so buckets are
filled from the last variable to the first, each up to `bucket_bytes`. In a
traced step every bucket is its own collective, whose inputs are its own
gradients only: TensorFlow starts it when they are ready, while the
backward pass continues (TensorFlow keeps collectives in program order
with its ordering token, so the first bucket also goes first).

Exactness: a bucket sums each element over the replicas as the single
all-reduce did (an element-wise SUM; which buffer an element travels in
does not change what is added to it), so kd against one device is
unchanged, bucketed or not. The step's metric states and row count ride in
the first bucket: no collective of their own.

The choice (`choose`) comes from what kd knows when a step is traced:

- `"auto"` (the default): buckets of `DEFAULT_BUCKET_BYTES` when the step
  spans several worker processes (each collective crosses the network)
  and the gradient holds at least `AUTO_MIN_BUCKETS` buckets' worth;
  else one all-reduce. Latency-bound steps (every model under about
  50 MiB of gradient, every in-process strategy) keep one collective.
- `"one"`: one all-reduce, always.
- a whole number of bytes: buckets of that size, always (with several
  replicas): for a slow link where a smaller gradient already waits for
  communication, or to test bucketing on one machine.
"""

import dataclasses

from keras_distrib import validation

__all__ = [
    "AUTO",
    "AUTO_MIN_BUCKETS",
    "BucketPlan",
    "DEFAULT_BUCKET_BYTES",
    "ONE",
    "check_setting",
    "choose",
    "split",
]

AUTO = "auto"
ONE = "one"
# PyTorch DDP's default bucket size: large enough that a bucket's latency is
# small beside its transfer on a 1-10 Gbit/s link.
DEFAULT_BUCKET_BYTES = 25 * 2**20
# Fewer buckets than this hide little (the last one always waits for the
# backward pass to end) and add a collective's latency.
AUTO_MIN_BUCKETS = 2


def check_setting(setting):
    """Raises ValueError unless `setting` is `"auto"`, `"one"` or a whole number of bytes >= 1."""
    if setting in (AUTO, ONE):
        return setting
    if not validation.is_whole(setting, 1):
        raise ValueError(
            f"`gradient_buckets`={setting!r}: expected \"auto\" (kd chooses from the gradient's "
            "bytes and the workers), \"one\" (one all-reduce of every gradient) or a whole number "
            f"of bytes >= 1 per bucket (e.g. {DEFAULT_BUCKET_BYTES}, PyTorch DDP's 25 MiB)."
        )
    return setting


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """How a step all-reduces its gradients (frozen; see `choose`).

    Attributes:
        bucket_bytes: Bytes per bucket, or None: one all-reduce.
        gradient_bytes: The dense gradient's bytes (one replica's).
        workers: Worker processes taking part in each step.
        setting: What was asked: `"auto"`, `"one"` or bytes.
    """

    bucket_bytes: object
    gradient_bytes: int
    workers: int
    setting: object

    @property
    def bucketed(self):
        return self.bucket_bytes is not None

    def describe(self, count=None):
        """One line for a person: what kd does and why (`count`: the buckets, when known)."""
        if self.bucketed:
            many = f"{count} all-reduces" if count is not None else "all-reduces"
            how = (f"{many} of up to {_size(self.bucket_bytes)}, each started as the backward "
                   "pass produces its gradients")
        else:
            how = "one all-reduce after the backward pass"
        if self.setting != AUTO:
            why = f"gradient_buckets={self.setting!r}"
        elif self.bucketed:
            why = (f"gradient_buckets=\"auto\": {self.workers} workers and at least "
                   f"{AUTO_MIN_BUCKETS} buckets of {_size(DEFAULT_BUCKET_BYTES)}")
        else:
            why = "gradient_buckets=\"auto\": latency dominates (" + (
                "one worker process" if self.workers < 2 else
                f"under {AUTO_MIN_BUCKETS} buckets of {_size(DEFAULT_BUCKET_BYTES)}") + ")"
        return (f"kd: {_size(self.gradient_bytes)} of gradients per replica, {self.workers} "
                f"worker(s): {how} ({why}).")


def _size(count):
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"


def choose(setting, *, gradient_bytes, workers):
    """The `BucketPlan` for a step (see the module docstring for the rule).

    Args:
        setting: `"auto"`, `"one"` or bytes per bucket (`check_setting`).
        gradient_bytes: Bytes of one replica's dense gradients.
        workers: Worker processes taking part in each step.

    Returns:
        A `BucketPlan`.

    Example:
        >>> from keras_distrib.training import buckets
        >>> buckets.choose("auto", gradient_bytes=100 * 2**20, workers=2).bucket_bytes == 25 * 2**20
        True
        >>> buckets.choose("auto", gradient_bytes=4 * 2**20, workers=2).bucketed
        False
    """
    check_setting(setting)
    if setting == ONE:
        size = None
    elif setting == AUTO:
        size = DEFAULT_BUCKET_BYTES if (
            workers > 1 and gradient_bytes >= AUTO_MIN_BUCKETS * DEFAULT_BUCKET_BYTES) else None
    else:
        size = setting
    return BucketPlan(bucket_bytes=size, gradient_bytes=int(gradient_bytes), workers=int(workers),
                      setting=setting)


def split(sizes, bucket_bytes):
    """Indices of `sizes` grouped into buckets, in the order the backward pass produces them.

    The last entry (the last layer's gradient, produced first) opens the
    first bucket; a bucket closes once it holds `bucket_bytes` or more. An
    entry larger than a bucket is a bucket of its own (gradients are not cut).

    Args:
        sizes: Bytes of each gradient, in the model's variable order.
        bucket_bytes: Bytes per bucket, or None: every index in one bucket.

    Returns:
        A list of buckets, each a list of indices into `sizes`.

    Example:
        >>> from keras_distrib.training import buckets
        >>> buckets.split([400, 40, 400, 40], 420)
        [[3, 2], [1, 0]]
        >>> buckets.split([400, 40], None)
        [[0, 1]]
    """
    if bucket_bytes is None:
        return [list(range(len(sizes)))]
    groups, current, filled = [], [], 0
    for index in reversed(range(len(sizes))):
        current.append(index)
        filled += sizes[index]
        if filled >= bucket_bytes:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return groups
