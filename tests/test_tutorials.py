"""Every tutorial runs top to bottom (offline, small parameters) and teaches true things."""

import json
import os
import shutil
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient

from keras_distrib import tf_logs
from tests import _harness

TUTORIALS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tutorials")


def run_notebook(name, parameters, report, workdir, figures=0, fresh=False):
    """Executes tutorials/<name>.ipynb with `parameters` injected after its
    parameters cell (as papermill does) and returns the `report` expression's value.

    `figures`: how many figures (PNG outputs: its curves) the run must show at least.
    The kernel is a child of the harness's warm interpreter (its imports done), or
    with `fresh` a new `python -m ipykernel_launcher`, whose start-up shows too."""
    notebook = nbformat.read(os.path.join(TUTORIALS, f"{name}.ipynb"), as_version=4)
    index = next(i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", []))
    injected = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(injected))
    notebook.cells.append(nbformat.v4.new_code_cell(f"import json\nprint('REPORT ' + json.dumps({report}))"))
    env_before = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    kernels = tempfile.mkdtemp(prefix="kd_kernel_")
    km = None if fresh else _harness.notebook_kernel(kernels)
    try:
        kernel = {"kernel_name": "python3"} if fresh else {"km": km}
        NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(workdir)}},
                       **kernel).execute()
    finally:
        if km is not None and km.has_kernel:  # (NotebookClient shuts down only the kernels it made)
            km.shutdown_kernel()
        shutil.rmtree(kernels)
        if env_before is None:
            os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
    # Readable output: kd hides TensorFlow's start-up notices (keras_distrib.tf_logs).
    noise = [line for cell in notebook.cells for output in cell.get("outputs", [])
             for line in output.get("text", "").splitlines() if tf_logs.is_startup_notice(line)]
    assert not noise, f"{name} shows TensorFlow's start-up notices: {noise[:3]}"
    shown = sum("image/png" in output.get("data", {}) for cell in notebook.cells
                for output in cell.get("outputs", []))
    assert shown >= figures, f"{name} showed {shown} figure(s), expected {figures}"
    for output in notebook.cells[-1].outputs:
        for line in output.get("text", "").splitlines():
            if line.startswith("REPORT "):
                return json.loads(line[7:])
    raise AssertionError(f"{name} printed no report: {notebook.cells[-1].outputs}")


@pytest.mark.cluster
def test_overview(tmp_path):
    result = run_notebook(
        "distributed_training_overview", {"DATA": "digits", "EPOCHS": 3, "LIMIT": 2000},
        "{'accuracy': TEST_ACCURACY, 'diff': MAX_WEIGHT_DIFF, 'plain': PLAIN_WEIGHT_DIFF, "
        "'replicas': strategy.num_replicas_in_sync}",
        tmp_path, figures=1, fresh=True,  # the first tutorial, from its first import as a reader runs it
    )
    assert result["replicas"] == 2
    assert result["diff"] <= 1e-5
    # The contrast its curves show: plain Keras under the same strategy (2.5e-3 when written).
    assert result["plain"] > 1e-4, result
    assert result["accuracy"] > 0.7, result


@pytest.mark.cluster
def test_custom_training_loop(tmp_path):
    result = run_notebook(
        "custom_training_loop", {"DATA": "digits", "EPOCHS": 2, "LIMIT": 2000},
        "{'trained': TRAINED, 'restored': RESTORED, 'total': total, 'custom': CUSTOM_STEP_DIFF, "
        "'plain': max_difference(runs['plain Keras'])}", tmp_path, figures=1,
    )
    # A train_step override with clipnorm and an activity regularizer: exact
    # with kd, far off with plain Keras under the same strategy.
    assert result["custom"] <= 1e-5, result
    assert result["plain"] > 1e-3, result
    assert result["restored"]["accuracy"] == result["trained"]["accuracy"]
    assert result["restored"]["loss"] == pytest.approx(result["trained"]["loss"], abs=1e-5)
    assert result["trained"]["accuracy"] > 0.5, result
    assert result["total"] == pytest.approx(3.0)


@pytest.mark.cluster
def test_multi_worker_custom_loop(tmp_path):
    result = run_notebook(
        "multi_worker_custom_loop", {"DATA": "digits", "EPOCHS": 3, "LIMIT": 2000, "KILL_AT_EPOCH": 2},
        "{'final': FINAL, 'restarts': result.restarts, 'files': sorted(os.listdir(checkpoint_dir))}",
        tmp_path,
    )
    assert result["restarts"] == 1
    assert result["final"]["start_epoch"] == 2 and result["final"]["chief"]
    assert result["final"]["accuracy"] > 0.3, result
    # (kd marks the directory it created with a hidden `.kd-created` file)
    assert [f for f in result["files"] if not f.startswith(".")] == ["ckpt-3", "latest"]


@pytest.mark.cluster
def test_migrate_multi_worker_training(tmp_path):
    result = run_notebook(
        "migrate_multi_worker_training", {"STEPS": 60},
        "{'ps_loss': PS_FINAL_LOSS, 'sync': SYNC, 'shards': len(embedding.variables), "
        "'devices': sorted({v.device.split('/device')[0] for v in embedding.variables}), "
        "'history': sorted(history.history), 'evaluations': EVALUATIONS, 'final': FINAL}",
        tmp_path,
    )
    assert result["shards"] == 2
    assert result["devices"] == ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"]
    assert result["ps_loss"] < 60.0
    assert result["history"] == ["loss", "val_loss"]
    values = list(result["sync"].values())
    assert len(values) == 2 and values[0] == values[1]
    # The sidecar evaluator's last evaluation is of the final weights.
    assert result["evaluations"], result
    for key, value in result["final"].items():
        assert abs(result["evaluations"][-1][key] - value) <= 1e-5 * (1 + abs(value)), result


@pytest.mark.xdist_group("keras_hub")  # takes turns with tests/test_ecosystem.py
@pytest.mark.cluster
@pytest.mark.long
def test_fine_tune_ecosystem_models(tmp_path):
    result = run_notebook(
        "fine_tune_ecosystem_models", {"ROWS": 33, "BATCH": 16, "EPOCHS": 1},
        "{'diff': MAX_DIFF, 'reloaded': RELOADED_SAME, 'plain': PLAIN_BERT, 'tags': GRAPH_TAGS, "
        "'reloaded_class': type(reloaded).__name__, 'compiled': reloaded.compiled, "
        "'steps': int(reloaded.optimizer.iterations.numpy()), "
        "'curves': BERT_CURVES}",
        tmp_path, figures=1,
    )
    # A KerasHub task and a keras.applications backbone: exact under the strategy.
    assert sorted(result["diff"]) == ["BertTextClassifier", "MobileNetV2 head"]
    assert max(result["diff"].values()) <= 2e-5, result
    # The same task on plain Keras fails, and the report shows TensorFlow's message.
    assert "failed (on one device it runs)" in result["plain"] and "bool" in result["plain"], result
    # The registered KerasHub subclass reloads as itself, compiled, with its
    # optimizer's steps (33 rows in batches of 16: 3 a epoch), and predicts the same.
    assert result["reloaded"] is True
    assert (result["reloaded_class"], result["compiled"], result["steps"]) == ("ExactBertClassifier", True, 3)
    assert "keras" in result["tags"], result  # the model graph, for kd's FunctionalModel
    # Its curves: the loss after each of 1 epoch's 3 steps, kd's one device's to round-off.
    curves = result["curves"]
    assert sorted(curves) == ["kd, mirrored", "one device"] and len(curves["one device"]) == 3, curves
    assert all(abs(a - b) <= 2e-5 * (1 + abs(a)) for a, b in zip(curves["one device"], curves["kd, mirrored"]))


@pytest.mark.cluster
def test_own_train_step(tmp_path):
    result = run_notebook(
        "own_train_step", {"EPOCHS": 2, "ROWS": 225},
        "{'parity': PARITY, 'curves': CURVES, 'weights': WEIGHT_DIFF}", tmp_path, figures=1,
    )
    # Every pattern (trackers, a loss object, a GAN, a VAE) passed assert_parity on
    # mirrored and central storage; the numbers it returned are within float32 round-off.
    assert sorted(result["parity"]) == ["gan", "own_loss", "trackers", "vae"], result
    for found in result["parity"].values():
        assert len(found) == 2 and all(value <= 2e-5 for value in found.values()), result
    curves = result["curves"]
    assert all(abs(a - b) <= 2e-5 * (1 + abs(a))
               for a, b in zip(curves["one device"], curves["kd.Model, mirrored"])), curves
    assert result["weights"]["kd.Model, mirrored"] <= 2e-5, result
    # The contrast: the same class body on keras.Model under the same strategy.
    assert result["weights"]["keras.Model, mirrored"] > 1e-3, result


@pytest.mark.cluster
@pytest.mark.long
def test_contrastive_learning(tmp_path):
    result = run_notebook(
        "contrastive_learning", {"DATA": "digits", "EPOCHS": 2, "LIMIT": 600},
        "{'dual': DUAL_DIFF, 'plain': DUAL_PLAIN_DIFF, 'simclr': SIMCLR_DIFF, "
        "'parity': max(PARITY.values()), 'caught': CAUGHT, 'recall': [reference_recall, kd_recall]}",
        tmp_path, figures=2,
    )
    # The dual encoder's in-batch negatives and the SimCLR-style step's arange
    # labels: one device's model on 2 replicas; plain Keras there is far off.
    assert result["dual"] <= 2e-5 and result["simclr"] <= 2e-5, result
    assert result["plain"] > 1e-3, result
    assert result["recall"][0] == result["recall"][1], result
    assert result["parity"] <= 2e-5, result
    assert 'likely cause: rows left to each replica: the model was compiled with ' \
        'rows_meet="per_replica"' in result["caught"], result["caught"][:2000]
