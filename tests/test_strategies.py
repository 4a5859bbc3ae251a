import re
import socket
import time

import pytest
import tensorflow as tf

import keras_distrib as kd
from tests import _harness


def test_unknown_kind_is_explained():
    with pytest.raises(ValueError, match=r"`kind`='mirror' is not a strategy kind.*'mirrored'"):
        kd.make_strategy("mirror")


def test_option_not_accepted_by_kind():
    with pytest.raises(ValueError, match=r"\['cross_device_ops'\] are not accepted by `kind`='one_device'"):
        kd.make_strategy("one_device", cross_device_ops="nccl")


def test_nccl_needs_gpus():
    with pytest.raises(ValueError, match="needs GPUs"):
        kd.make_strategy("mirrored", cross_device_ops="nccl")
    with pytest.raises(ValueError, match="needs GPUs"):
        kd.make_strategy("mirrored", cross_device_ops="hierarchical_copy")


def test_bad_cross_device_ops_value():
    with pytest.raises(ValueError, match=r"`cross_device_ops`='ring' is not supported"):
        kd.make_strategy("mirrored", cross_device_ops="ring")


@pytest.mark.parametrize("kind", ["mirrored", "one_device", "central_storage"])
def test_missing_devices_are_refused_at_creation(kind):
    # TensorFlow accepts them, and the first step hangs waiting for them.
    devices = ["/gpu:0", "/gpu:1"] if kind != "one_device" else ["/cpu:5"]
    with pytest.raises(ValueError, match=r"`devices`=.*: no such device\(s\) .* on this machine; "
                                         r"available: \['/device:CPU:0'.*kd\.virtual_devices"):
        kd.make_strategy(kind, devices=devices)
    with pytest.raises(ValueError, match=r"`devices`=\['/cpu:0', '/cpu:0'\]: device\(s\) \['/cpu:0'\] "
                                         r"listed more than once"):
        kd.make_strategy("mirrored", devices=["/cpu:0", "/cpu:0"])


def test_tpu_absent_is_explained(monkeypatch):
    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.delenv("COLAB_TPU_ADDR", raising=False)
    with pytest.raises(ValueError, match="no TPU was found"):
        kd.make_strategy("tpu")


@pytest.mark.parametrize("variable,value", [("TPU_NAME", "local"), ("COLAB_TPU_ADDR", "10.0.0.2:8470"),
                                            ("TPU_WORKER_HOSTNAMES", "t1k-worker-0")])
def test_a_tpu_variable_without_a_tpu_is_named_with_the_fix(monkeypatch, variable, value):
    # TensorFlow's resolver raised URLError ("Name or service not known") for TPU_NAME=local.
    for name in ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"kd looked for a TPU because of {variable}='{re.escape(value)}' "
                                         rf"in the environment, but TensorFlow could not resolve it \(\w+.*\)\. "
                                         rf"On a machine without a TPU, unset it \(`unset {variable}`\)"):
        kd.make_strategy("auto")


def test_a_tpu_address_that_does_not_answer_is_refused_at_once(monkeypatch):
    # TensorFlow waits for ever on it (measured: still waiting after 300 s).
    for name in ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"because of `tpu`='grpc://localhost:{port}', but its worker "
                                         rf"localhost:{port} does not accept a connection .*Refused.*"
                                         r"Pass `tpu=` the name or grpc:// address of a TPU"):
        kd.make_strategy("tpu", tpu=f"grpc://localhost:{port}")
    assert time.monotonic() - started < 10


def test_parameter_server_needs_ps_tasks(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="needs a cluster with 'ps' tasks"):
        kd.make_strategy("parameter_server")


def test_default_and_one_device():
    assert kd.make_strategy("default") is tf.distribute.get_strategy()
    one = kd.make_strategy("one_device")
    assert isinstance(one, tf.distribute.OneDeviceStrategy)


@pytest.mark.cluster
def test_auto_picks_by_environment():
    code, output = _harness.run_script("strategy_kinds.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    assert result == {
        "auto": "MirroredStrategy",
        "auto_replicas": 2,
        "central_storage": 2,
        "reduce_to_one_device": 2,
        "ring_multi_worker": [True, "RING"],
        "traits": {
            "default": ["default", 1, 1],
            "one_device": ["one_device", 1, 1],
            "mirrored": ["mirrored", 2, 1],
            "central_storage": ["central_storage", 2, 1],
            "multi_worker": ["multi_worker", 2, 1],
        },
        "auto_with_tf_config": "multi_worker",
        "auto_with_ps": "parameter_server",
    }


@pytest.mark.cluster
def test_second_mirrored_strategy_in_one_process():
    """A notebook makes a second MirroredStrategy: kd's own ones train exactly,
    a second tf.distribute.MirroredStrategy is refused before its first
    collective, where plain Keras aborts in it."""
    code, output = _harness.run_script("second_strategy.py")
    assert code == 0, output[-4000:]
    (result,) = _harness.results_of(output)
    # Three kd.make_strategy("mirrored") in turn, each checked against one device.
    assert len(result["make_strategy"]) == 3 and max(result["make_strategy"]) <= 2e-5, result
    # Reusing one strategy for models of other shapes is what the error advises.
    assert len(result["reused"]) == 2 and max(result["reused"]) <= 2e-5, result
    assert "second tf.distribute.MirroredStrategy" in result["kd_second"], result
    assert "Reuse the first strategy" in result["kd_second"]
    assert 'kd.make_strategy("mirrored")' in result["kd_second"]
    assert "Shape mismatch in the collective instance" in result["keras_second"], result


def test_traits_are_asked_once_and_frozen():
    import dataclasses

    from keras_distrib.cluster import strategies

    strategy = kd.make_strategy("one_device")
    found = strategies.traits(strategy)
    assert found is strategies.traits(strategy)
    assert (found.kind, found.replicas, found.workers) == ("one_device", 1, 1)
    assert not (found.is_parameter_server or found.is_multi_worker or found.replica_threads)
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.kind = "mirrored"
    assert strategies.traits().kind == "default"


def test_traits_of_an_unknown_strategy_are_refused():
    from keras_distrib.cluster import strategies

    with pytest.raises(TypeError, match=r"`strategy`=.* is not a strategy kd supports"):
        strategies.traits(object())
