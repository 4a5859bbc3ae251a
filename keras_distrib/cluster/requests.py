"""A launch request, checked before anything starts.

`launch`, `keras-distrib launch` and the per-node agent (`node.launch_node`)
check their arguments here: every bad one is listed in one `LaunchError`
(the argument, what was received, what was expected), and no process,
port reservation or network namespace exists yet when it is raised.
"""

import collections.abc
import dataclasses
import importlib.util
import os
import pickle
import shlex

from keras_distrib.cluster import network
from keras_distrib.cluster import ports as ports_lib
from keras_distrib.cluster import restarts
from keras_distrib.cluster.ports import LaunchError
from keras_distrib import validation

__all__ = [
    "AUTO",
    "DEFAULT_GRACE_PERIOD",
    "NETWORK_OPTIONS",
    "NetworkLevel",
    "NoPrivateNetwork",
    "OFFLINE",
    "check_data_workers",
    "check_grace_period",
    "check_min_workers",
    "check_private_network",
    "checked_target",
    "script_target",
    "validate",
]

# Seconds the tasks get to save and exit when the launcher is told to stop
# (a preemption); below Slurm's KillWait and Kubernetes' default grace (30 s).
DEFAULT_GRACE_PERIOD = 25.0
# `private_network=OFFLINE`: a namespace of their own, without a route out.
OFFLINE = "offline"
# `private_network=AUTO` (the default): the most private network this host
# allows, a route out (True) before none (OFFLINE); never open (False) unasked.
AUTO = "auto"
# The commands' `--network` values, and the `private_network` each means.
NETWORK_OPTIONS = {"auto": AUTO, "private": True, "offline": OFFLINE, "open": False}


class NoPrivateNetwork(LaunchError):
    """The private network a launch asks for (by default: any) cannot be made here.

    `reason` says why in a few words, without advice, so that a front end
    (the demo, the self-test) can word its own, naming its own options;
    `offline_possible`: a namespace without a route out can be made here.
    """

    def __init__(self, message, *, reason, offline_possible):
        super().__init__(message)
        self.reason = reason
        self.offline_possible = offline_possible

    def remedy(self, command):
        """The one `command` line (a command with `--network`) that runs the workers here, and how."""
        if self.offline_possible:
            return f"`{command} --network offline` runs them in a private network without a route out"
        return (f"`{command} --network open` runs them on this host's network, their ports open to "
                "it while they run")


@dataclasses.dataclass(frozen=True)
class NetworkLevel:
    """The network a local launch's tasks get, decided once per launch.

    `mode`: what `supervisor.run_tasks` takes as `private_network` (True,
    `OFFLINE` or False). `note`: the one line a launch with `AUTO` prints
    (None otherwise). `no_route_out`: for a launch without a route out, the
    advice a failure on a network error ends with (None otherwise).
    """

    mode: object
    note: str = None
    no_route_out: str = None

    @property
    def name(self):
        """'private' (a route out), 'offline' (none) or 'open' (this host's network)."""
        return "private" if self.mode is True else "offline" if self.mode == OFFLINE else "open"


def _args_problems(args, script):
    if isinstance(args, (str, bytes)):
        try:
            example = shlex.split(os.fsdecode(args))
        except ValueError:  # unbalanced quotes
            example = [os.fsdecode(args)]
        return [
            f"`args`={args!r} is a string, which would be split into characters; pass a "
            f"list of arguments, e.g. `args`={example!r}"
        ]
    if not isinstance(args, (list, tuple)):
        return [f"`args`={args!r}: expected a list or tuple of arguments"]
    if script:
        bad = [a for a in args if isinstance(a, bool) or not isinstance(a, (str, int, float, os.PathLike))]
        if bad:
            return [
                f"`args` items {bad!r} are not command-line values; a script takes "
                "strings (or numbers and paths, converted with str())"
            ]
        return []
    try:
        pickle.dumps(tuple(args))
    except Exception as error:  # noqa: BLE001 - pickling raises many types
        return [
            f"`args` cannot be sent to the tasks ({type(error).__name__}: {error}); "
            "a function target takes picklable arguments"
        ]
    return []


def validate(workers, ps, chief, max_restarts, timeout, ports=None, *, args=(), script=True,
             env=None, log_dir=None, sink=print, evaluator=False, verbose=False):
    """Raises `LaunchError` listing every invalid launch argument (nothing is started)."""
    problems = []
    if not validation.is_whole(workers, 1):
        problems.append(f"`workers`={workers!r}: expected a whole number >= 1")
    if not validation.is_whole(ps, 0):
        problems.append(f"`ps`={ps!r}: expected a whole number >= 0")
    if not isinstance(chief, bool):
        problems.append(f"`chief`={chief!r}: expected True or False")
    elif ps and chief:
        problems.append(
            "`chief` with `ps`: in a parameter-server cluster the script itself "
            "is the coordinator (chief); drop `chief`"
        )
    if not validation.is_whole(max_restarts, 0) or max_restarts > restarts.MAX_RESTARTS:
        problems.append(f"`max_restarts`={max_restarts!r}: expected a whole number in "
                        f"0..{restarts.MAX_RESTARTS} (each restart waits up to {restarts.RESTART_BACKOFF_MAX:g}s "
                        "after a quick failure)")
    if timeout is not None and not validation.is_seconds(timeout):
        problems.append(
            f"`timeout`={timeout!r}: expected a finite number of seconds > 0, or None for "
            "no limit"
        )
    problems.extend(_args_problems(args, script))
    if env is not None and (
        not isinstance(env, collections.abc.Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        problems.append(
            f"`env` must map names to strings (like os.environ), got {type(env).__name__}"
            + (f" with non-string entries {[k for k, v in env.items() if not isinstance(v, str)]}"
               if isinstance(env, collections.abc.Mapping) else "")
        )
    if log_dir is not None:
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            problems.append(f"`log_dir`={log_dir!r}: expected a directory path, or None")
        elif os.path.exists(log_dir) and not os.path.isdir(log_dir):
            problems.append(f"`log_dir`={os.fspath(log_dir)!r} is a file; give a directory")
    if not isinstance(evaluator, bool):
        problems.append(f"`evaluator`={evaluator!r}: expected True or False")
    if not isinstance(verbose, bool):
        problems.append(f"`verbose`={verbose!r}: expected True or False")
    if not callable(sink):
        problems.append(f"`sink`={sink!r}: expected a callable taking one line (like print)")
    if ports is not None:
        port_problems = ports_lib.port_problems(ports)
        problems.extend(port_problems)
        counts_valid = (validation.is_whole(workers, 1) and validation.is_whole(ps, 0)
                        and isinstance(chief, bool))
        if not port_problems and counts_valid:
            needed = workers + ps + (1 if (chief or ps) else 0)
            if len(ports) != needed:
                problems.append(
                    f"`ports` lists {len(ports)} port(s) but the cluster has {needed} "
                    "task(s); give one port per task, or leave `ports` out to pick free ones"
                )
            taken = [p for p in ports if not ports_lib.port_is_free(p)]
            if taken:
                problems.append(
                    f"`ports` {taken} already in use on localhost; stop what listens "
                    "there, or leave `ports` out to pick free ones"
                )
    if problems:
        raise LaunchError("Invalid launch request:\n  - " + "\n  - ".join(problems))


def _grace_problems(grace_period):
    if grace_period is None or validation.is_seconds(grace_period, zero=True):
        return []
    return [f"`grace_period`={grace_period!r}: expected a finite number of seconds >= 0"]


def check_grace_period(grace_period):
    """Raises `LaunchError` unless `grace_period` is None or a finite number of seconds >= 0."""
    problems = _grace_problems(grace_period)
    if problems:
        raise LaunchError("Invalid launch request:\n  - " + "\n  - ".join(problems))


def check_data_workers(data_workers):
    """Raises `LaunchError` unless `data_workers` is a whole number >= 0."""
    if not validation.is_whole(data_workers, 0):
        raise LaunchError(f"Invalid launch request:\n  - `data_workers`={data_workers!r}: expected a "
                          "whole number >= 0 (data worker processes of a tf.data service started "
                          "beside the training tasks)")


def check_min_workers(min_workers, workers, ps):
    """Raises `LaunchError` unless `min_workers` is None or 1..`workers`, without `ps`."""
    if min_workers is None:
        return
    problem = None
    if not validation.is_whole(min_workers, 1):
        problem = f"`min_workers`={min_workers!r}: expected a whole number >= 1, or None"
    elif validation.is_whole(workers, 1) and min_workers > workers:
        problem = (f"`min_workers`={min_workers} is more than the {workers} workers launched; "
                   f"give at most {workers}")
    elif ps:
        problem = (f"`min_workers`={min_workers} with `ps`={ps}: a parameter-server cluster's "
                   "coordinator already carries on without a lost worker (its steps run on the "
                   "others); drop `min_workers`")
    if problem:
        raise LaunchError("Invalid launch request:\n  - " + problem)


def check_private_network(private_network):
    """The `NetworkLevel` a launch with `private_network` gets here.

    True, `OFFLINE` and False are met or refused; `AUTO` takes the most
    private network this host allows: a namespace with a route out, else one
    without (the note says why, and how to get the route), else none, which
    is refused (`NoPrivateNetwork`: kd never opens the tasks' ports unasked).
    A namespace is made and closed to find out.

    Raises:
        LaunchError: `private_network` is none of those, or what it asks for
            cannot be made here (`NoPrivateNetwork` for `AUTO`); the message
            says why and what to do.
    """
    if not (isinstance(private_network, bool) or private_network in (OFFLINE, AUTO)):
        raise LaunchError(f"Invalid launch request:\n  - `private_network`={private_network!r}: "
                          f"expected {AUTO!r} (the default), True, {OFFLINE!r} or False")
    if private_network is False:
        return NetworkLevel(False)
    if private_network != AUTO:
        try:
            network.PrivateNetwork(outbound=private_network is True).close()
        except network.NoRouteOut as error:
            raise NoPrivateNetwork(str(error), reason=error.reason, offline_possible=True) from None
        except network.NoNamespace as error:
            raise NoPrivateNetwork(str(error), reason=error.reason, offline_possible=False) from None
        return _level(private_network, explicit=True)
    try:
        made = network.PrivateNetwork(outbound=True)
        made.close()
        return _level(True, explicit=False, route_out=made.route_out)
    except network.NoRouteOut as error:
        missing = error
    except network.NoNamespace as error:
        raise _no_private_network(error) from None
    try:
        network.PrivateNetwork(outbound=False).close()
    except network.NoNamespace as error:
        raise _no_private_network(error) from None
    return _level(OFFLINE, explicit=False, missing=missing)


def _no_private_network(error):
    return NoPrivateNetwork(
        f"`private_network`: kd keeps a local launch's tasks in a network namespace of their "
        f"own (TensorFlow's servers have no authentication), and {error.reason}: "
        f"{network.ALLOW_NAMESPACES}; or launch with `private_network=False` (`--network open`), "
        "which opens the tasks' ports to this host's network (firewall them).",
        reason=error.reason, offline_possible=False)


def _level(mode, *, explicit, missing=None, route_out=None):
    """`missing`: the `NoRouteOut` of an `AUTO` launch without a route out."""
    routes = f"{network.SLIRP} or {network.PASTA}"
    if mode is True:
        return NetworkLevel(True, None if explicit else (
            f"[launcher] network: private, with a route out through {route_out} (no other "
            "host or user reaches the tasks' ports)"))
    if explicit:
        return NetworkLevel(OFFLINE, None, (
            "the tasks ran in a private network without a route out (`private_network="
            "\"offline\"`, `--network offline`); launch without it to give them one through "
            f"{routes}."))
    absent = not network.routes_out()
    return NetworkLevel(OFFLINE, (
        f"[launcher] network: private, without a route out ({missing.reason}): the tasks reach "
        f"each other and nothing else; "
        + (f"{routes} would give them one" if absent else
           f"to give them one, {missing.fix}")), (
        f"the tasks ran in a private network without a route out ({missing.reason}): "
        f"{missing.fix} to give them one, or launch with `private_network=False` (`--network "
        "open`: the tasks' ports open to this host's network)."))


def checked_target(target):
    """None for a script that exists; a function's `"module:name"` spec whose module is found.

    Raises:
        LaunchError: no such script, or a function no task could import.
    """
    from keras_distrib.cluster import _task_entry

    if isinstance(target, str) and ":" not in target:
        if not os.path.isfile(target):
            raise LaunchError(
                f"`target`={target!r} is not a file. Pass the path of a Python "
                "script, a function, or 'package.module:function'."
            )
        return None
    try:
        spec = _task_entry.function_spec(target)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    module = spec.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise LaunchError(
            f"`target`={target!r}: module {module!r} cannot be found on sys.path, so no "
            "task could import it. Check the spelling, or pass a script path."
        )
    return spec


def script_target(target):
    """`target` as a string or callable, and whether it is a script."""
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    return target, isinstance(target, str) and ":" not in target
