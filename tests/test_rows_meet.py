"""Rows that meet in the batch: exact on any layout, or refused naming the op and the fix.

Each pattern of tests/scripts/rows_meet.py (a dual encoder's in-batch
contrastive loss with soft targets in its own `compute_loss`, a SimCLR-style
step with `arange` labels written inline and its own `compile`, a layer
standardizing over the batch, a layer returning the batch's mean that a Keras
layer subtracts from the rows, a compiled loss mining the batch for its
hardest triplets, a hand-written loop gathering the global batch with
`kd.losses.global_batch`) is a class whose only change is its base class:
`keras.Model` on one device (the reference) against `kd.Model` under a
strategy, from the same initial weights, on 225 rows in global batches of 32
(the last batch has 1 row, one replica none). Weights and every logged value
(History, evaluate, predict) are compared, float64 within 1e-9 and float32
within 2e-5 (float64 only under central storage and between worker processes).
One process per strategy layout runs every pattern; the one-device runs are
shared by the processes of the test run.

What kd cannot read (tests/scripts/rows_policy.py): Keras's MixUp and
CutMix inside a model, and compiled losses through ops kd's op table does
not read (a while loop over the batch's rows into a square root, `Lgamma`),
are exact against one device; the same loss in a hand-written loop is
refused naming the op. Every layer Keras exports has a verdict on its rows.
"""

import pytest

from tests import _harness

PATTERNS = ["dual_encoder", "info_nce", "batch_statistics", "batch_context", "mined_triplets",
            "by_hand"]
TOLERANCE = {True: 1e-9, False: 2e-5}


def _check(results, configs, dtypes):
    by_key = {(r["config"], r["float64"], r["pattern"]): r for r in results}
    expected = {(c, d == "float64", p) for c in configs for d in dtypes for p in PATTERNS
                if not c.startswith(("spe3-", "per_replica-")) or (d == dtypes[0] and p != "by_hand")}
    expected -= {(c, f, p) for c, f, p in expected if c.startswith("per_replica-") and p not in CONTRASTED}
    assert set(by_key) == expected, sorted(set(by_key) ^ expected)
    failures = [r for r in results if not r["config"].startswith("per_replica")
                and ("error" in r or not (r["weights"] <= TOLERANCE[r["float64"]]
                                          and r["logs"] <= TOLERANCE[r["float64"]]))]
    assert not failures, failures
    return by_key


REFUSED = ["batch_statistics_jit", "by_hand_local"]
# The patterns whose contrast (kd told to leave each replica its rows) is asserted below:
# tests/scripts/rows_meet.py runs only those.
CONTRASTED = ("dual_encoder", "info_nce", "batch_statistics", "mined_triplets")


@pytest.mark.cluster
@pytest.mark.long
def test_rows_that_meet_match_one_device_on_mirrored_replicas():
    # (steps_per_execution=3: a gather cannot sit in a compiled loop, whose
    # collectives keep their first shape; kd runs one step per call, exact.)
    configs, dtypes = ["mirrored2", "per_replica-mirrored2", "spe3-mirrored2"], ["float64", "float32"]
    code, output = _harness.run_script("rows_meet.py", ",".join(configs),
                                       ",".join(PATTERNS + REFUSED), ",".join(dtypes), timeout=600)
    assert code == 0, output[-4000:]
    results = _harness.results_of(output)
    refused = {(r["config"], r["float64"], r["pattern"]): r for r in results if r["pattern"] in REFUSED}
    by_key = _check([r for r in results if r["pattern"] not in REFUSED], configs, dtypes)
    # Where kd cannot give a computation the global batch, it refuses at the
    # first trace, naming the layer or the op and the fix: a layer whose rows
    # meet, inside a forward pass XLA compiles on CPU replicas ...
    error = refused[("mirrored2", True, "batch_statistics_jit")]["error"]
    assert "layer 'standardize" in error and "makes the rows of the batch meet" in error, error
    assert "Use jit_compile=False" in error, error
    # ... and a hand-written loop whose in-batch negatives are the replica's own.
    error = refused[("mirrored2", True, "by_hand_local")]["error"]
    assert "`per_example_loss` depends on the rows of the batch together: `MatMul` (MatMul) " \
        "multiplies two row-aligned tensors across the batch" in error, error
    assert "kd.losses.global_batch(tensor)" in error, error
    # The contrast: kd told to leave each replica its own rows trains another
    # model, as plain Keras does (the SimCLR step fails on the empty replica).
    for pattern in ("dual_encoder", "batch_statistics", "mined_triplets"):
        result = by_key[("per_replica-mirrored2", True, pattern)]
        assert result["weights"] > 1e-3 and result["logs"] > 1e-2, result
    assert "InvalidArgumentError" in by_key[("per_replica-mirrored2", True, "info_nce")]["error"]
    # What TensorFlow runs per training step and replica: the gathered site's
    # rows (one all-reduce per dtype; the row counts come with the step's
    # own), the gradients (with the metric states when they can ride along),
    # and for a layer computed on the global batch the gather's gradient.
    counts = {pattern: by_key[("mirrored2", True, pattern)]["collectives"]["train"]["step"]
              for pattern in ("dual_encoder", "info_nce", "batch_statistics", "batch_context",
                              "mined_triplets")}
    assert counts == {"dual_encoder": 4, "info_nce": 7, "batch_statistics": 4, "batch_context": 4,
                      "mined_triplets": 3}, counts


@pytest.mark.cluster
@pytest.mark.long
def test_rows_that_meet_match_one_device_under_central_storage():
    # (float64 only: float32's round-off is measured on mirrored replicas above;
    # here what differs is where the variables live and how updates reach them.)
    configs, dtypes = ["central_storage2"], ["float64"]
    code, output = _harness.run_script("rows_meet.py", ",".join(configs), ",".join(PATTERNS),
                                       ",".join(dtypes), timeout=600)
    assert code == 0, output[-4000:]
    _check(_harness.results_of(output), configs, dtypes)


@pytest.mark.cluster
@pytest.mark.long
def test_rows_that_meet_match_one_device_on_two_worker_processes():
    # (float64 only: float32's round-off is measured on the replicas of one
    # process above; here what differs is the collectives between processes.)
    configs, dtypes = ["multi_worker"], ["float64"]
    result, output = _harness.run_cluster("rows_meet.py", ",".join(configs), ",".join(PATTERNS),
                                          ",".join(dtypes), workers=2, timeout=600)
    assert result.returncode == 0, output[-4000:]
    by_task = _harness.results_by_task(output)
    assert sorted(by_task) == ["worker 0", "worker 1"]
    for results in by_task.values():
        _check(results, configs, dtypes)


def test_every_keras_layer_has_a_verdict_on_its_rows():
    # Keras's layers are trusted by name only where listed (forward's lists,
    # docs/concepts/exactness.md): a layer Keras adds is read instead, and
    # this test names it for a verdict. Every Random* layer is listed as
    # drawing per row (laid out) or as mixing rows (MixUp's kind).
    import keras

    from keras_distrib.training import forward

    exported = {name for name in dir(keras.layers)
                if isinstance(getattr(keras.layers, name), type)
                and issubclass(getattr(keras.layers, name), keras.layers.Layer)}
    classes = {getattr(keras.layers, name) for name in exported}
    listed = [name for names in forward.KERAS_LAYER_LISTS.values() for name in names]
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    by_class = {getattr(keras.layers, name) for name in listed if name in exported}
    missing = sorted(c.__name__ for c in classes - by_class)
    assert not missing, f"Keras layers without a verdict on their rows: {missing}"
    random_named = {name for name in exported if name.startswith("Random")}
    assert random_named <= set(forward.KERAS_LAYER_LISTS["per_row_random"])
    assert set(forward.KERAS_LAYER_LISTS["rows_meet"]) == {"MixUp", "CutMix"}


POLICY_PATTERNS = ["mixup", "mixup_static", "cutmix", "cutmix_static", "while_loss", "unread_loss",
                   "draws", "mixup_plain", "unread_by_hand"]


@pytest.mark.cluster
def test_what_kd_cannot_read_is_exact_or_refused():
    # MixUp and CutMix inside the model (dynamic and static batch shapes, a
    # replica without rows in the last batch), a layer of the user's own
    # drawing gamma, beta, binomial and shuffle, and losses through ops kd's
    # table does not read: exact against one device, on 2 mirrored replicas.
    code, output = _harness.run_script("rows_policy.py", ",".join(POLICY_PATTERNS),
                                       "float64,float32", timeout=600)
    assert code == 0, output[-4000:]
    results = {(r["pattern"], r["float64"]): r for r in _harness.results_of(output)}
    once = ("mixup_plain", "unread_by_hand")
    assert sorted(results) == sorted((p, f) for p in POLICY_PATTERNS for f in (True, False)
                                     if f or p not in once)
    for (pattern, float64), result in results.items():
        if pattern in once:
            continue
        assert "error" not in result, result
        assert result["weights"] <= TOLERANCE[float64] and result["logs"] <= TOLERANCE[float64], result
    # The contrast: plain Keras under the strategy mixes each replica's own rows.
    plain = results[("mixup_plain", True)]
    assert plain["weights"] > 1e-3 and plain["logs"] > 1e-2, plain
    # A hand-written loop, where kd cannot gather: refused, the op named.
    error = results[("unread_by_hand", True)]["error"]
    assert "ValueError: " in error and "`Lgamma` (Lgamma) is an op kd cannot read" in error, error
    assert "kd.losses.global_batch(tensor)" in error and 'rows_meet="per_replica"' in error, error
