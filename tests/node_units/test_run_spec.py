"""The run specification travels through the real command lines unchanged.

``TrainSpec.to_argv`` parsed by ``node run`` gives the same spec back (any spec: property-tested); the join
command is that spec's joiner part; ``skippipe up``'s flags become one spec, and each daemon's command line,
parsed by ``node run``, gives that spec back with only the node's own stage added.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import string
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.cli import build_parser
from node.cli.train_args import MODEL_SIZE_NAMES
from node.cli.up_runners import UP_SPEC, UpOptions, _daemon_spec, _node_args
from node.cli.validate import MAX_DURATION_S, MAX_MEMORY_SLOTS, MAX_MICROBATCHES, MAX_NODES, MAX_STAGES, MAX_THREADS
from node.launch.process_swarm import ProcessSwarm
from node.spec import BRANCH_SCALING_MODES, DEADLINE_SOURCES, HEDGING_MODES, JOIN_FIELDS, TrainSpec
from node.train.precision import DEVICES, PRECISIONS
from protocol.compression import WIRE_TABLE

#: Enough examples to reach the corners (values that start with "-", unset optionals, both stage choices),
#: few enough for two shared cores; no deadline because a loaded CI box's timing is not what is checked.
SPEC_EXAMPLES = settings(max_examples=150, deadline=None)

#: "--" alone is argparse's end-of-options marker, which to_argv refuses to write (tested below); a path
#: spelled "--" is written as "./--"
_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " -_=./:~", max_size=12).filter(lambda s: s != "--")
_PATH = st.text(alphabet=string.ascii_letters + string.digits + "-_. ", min_size=1, max_size=12).map(pathlib.Path)


def _positive(hi: float) -> st.SearchStrategy:
    return st.floats(min_value=0, max_value=hi, exclude_min=True, allow_nan=False, allow_infinity=False)


#: One strategy per field: a field added to TrainSpec without one fails test_every_field_has_a_strategy.
FIELDS = {
    "train": st.booleans(),
    "model": st.sampled_from(MODEL_SIZE_NAMES),
    "model_config": st.none() | _PATH,
    "corpus": _TEXT,
    "text_field": _TEXT.filter(bool),  # an empty field name stands for the default, as on the command line
    "tokenizer": st.none() | _TEXT,
    "iterations": st.integers(1, 10**9),
    "lr": st.none() | _positive(10.0),
    "seed": st.integers(0, 2**32 - 1),
    "microbatch_size": st.integers(1, 65536),
    "seq_len": st.none() | st.integers(2, 1 << 20),
    "device": st.sampled_from(DEVICES),
    "precision": st.sampled_from(["auto", *PRECISIONS]),
    "wire": st.sampled_from(list(WIRE_TABLE)),
    "min_members": st.integers(1, MAX_NODES),
    "checkpoint_dir": st.none() | _PATH,
    "checkpoint_every": st.integers(0, 10**9),
    "resume": st.booleans(),
    "num_stages": st.none() | st.integers(2, MAX_STAGES),
    "path_length": st.none() | st.integers(2, MAX_STAGES),
    "microbatches": st.integers(1, MAX_MICROBATCHES),
    "memory_slots": st.integers(1, MAX_MEMORY_SLOTS),
    "run_id": _TEXT,
    "heartbeat": st.floats(0.05, 3600.0),
    "threads": st.none() | st.integers(1, MAX_THREADS),
    "iteration_timeout": _positive(MAX_DURATION_S),
    "agreement_timeout": _positive(MAX_DURATION_S),
    "deadlines": st.sampled_from(DEADLINE_SOURCES),
    "hedging": st.sampled_from(HEDGING_MODES),
    "branch_scaling": st.sampled_from(BRANCH_SCALING_MODES),
}
#: --stages and --auto exclude each other
_STAGE_CHOICE = (st.just((None, False)) | st.just((None, True))
                 | st.lists(st.integers(0, MAX_STAGES - 1), min_size=1, max_size=6).map(lambda s: (tuple(s), False)))
SPECS = st.tuples(st.fixed_dictionaries(FIELDS), _STAGE_CHOICE).map(
    lambda t: TrainSpec(**t[0], stages=t[1][0], auto=t[1][1]))


@functools.lru_cache(maxsize=1)
def _parser():
    return build_parser()  # parsing does not change it; building it per example would dominate the test's time


def _node_run(argv) -> TrainSpec:
    return TrainSpec.from_args(_parser().parse_args(["node", "run", *argv]))


def test_every_field_has_a_strategy_and_is_a_node_run_flag():
    names = {f.name for f in dataclasses.fields(TrainSpec)}
    assert names == set(FIELDS) | {"stages", "auto"}
    assert names <= set(vars(build_parser().parse_args(["node", "run"])))
    assert _node_run([]) == TrainSpec()  # node run's defaults are the spec's


@SPEC_EXAMPLES
@given(SPECS)
def test_to_argv_round_trips_through_node_run(spec):
    argv = spec.to_argv()
    assert _node_run(argv) == spec
    assert all(flag.startswith("--") for flag in argv if flag.startswith("-"))  # a "-x" value is "--flag=-x"


def test_a_path_spelled_like_the_end_of_options_marker_survives_and_plain_text_is_refused():
    odd = TrainSpec(checkpoint_dir=pathlib.Path("--"), model_config=pathlib.Path("-x"))
    assert _node_run(odd.to_argv()) == odd
    with pytest.raises(ValueError, match="cannot be passed"):
        TrainSpec(run_id="--").to_argv()


@SPEC_EXAMPLES
@given(SPECS)
def test_join_argv_is_the_joiners_part_of_the_spec(spec):
    joiner = _node_run(spec.join_argv())
    if not spec.train:
        assert joiner == TrainSpec()
        return
    assert joiner == replace(TrainSpec(), **{name: getattr(spec, name) for name in JOIN_FIELDS})


def test_up_flags_become_one_spec_and_every_daemon_parses_back_to_it(tmp_path):
    up = build_parser().parse_args(["up", "--out", str(tmp_path), "--num-stages", "3", "--replicas", "2,1",
                                    "--data-nodes", "1", "--path-length", "3", "--microbatches", "3", "--memory", "5",
                                    "--lr", "0.01", "--seed", "4", "--wire", "int8", "--corpus", "-odd name-"])
    spec = TrainSpec.from_args(up, base=UP_SPEC)
    assert (spec.memory_slots, spec.lr, spec.wire, spec.iterations, spec.threads) == (5, 0.01, "int8", 40, 1)
    opts = UpOptions(spec, out=str(tmp_path), data_nodes=1, replicas="2,1")
    daemon = _daemon_spec(opts, tmp_path, 4)
    swarm = ProcessSwarm(4, [1, 2, 1], base_dir=tmp_path / "nodes", spec=daemon, extra_args=_node_args(opts))
    assert set(vars(opts)) & {f.name for f in dataclasses.fields(TrainSpec)} == set()  # each setting in one place
    for node in swarm.nodes:
        argv = swarm.command(node)
        assert argv[1:5] == ["-m", "node", "node", "run"]
        parsed = build_parser().parse_args(argv[3:])
        assert TrainSpec.from_args(parsed) == replace(daemon, num_stages=3, stages=(node.stage,))
        assert parsed.node_name == f"node{node.index}"
    assert (daemon.min_members, daemon.checkpoint_dir, daemon.run_id) == (4, tmp_path / "checkpoints", "up")


def _subparser(*path):
    parser = build_parser()
    for name in path:
        parser = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
    return parser


def test_every_run_flag_is_declared_once_for_node_run_up_and_swarm_local():
    """A spec field's flag in ``node run``, ``up`` and ``swarm local`` is :data:`RUN_FLAGS`' declaration (its
    type and choices), with the command's spec as its default: none declares its own copy."""
    from node.cli.run_args import RUN_FLAGS
    from node.launch.process_swarm import LOCAL_SPEC

    fields = {f.name for f in dataclasses.fields(TrainSpec)}
    for path, defaults, count in ((("node", "run"), TrainSpec(), len(fields) - 2), (("up",), UP_SPEC, 19),
                                  (("swarm", "local"), LOCAL_SPEC, 3)):
        actions = [a for a in _subparser(*path)._actions if a.dest in fields and a.dest not in ("stages", "auto")]
        assert len({a.dest for a in actions}) == len(actions) == count, path  # node run: all but its stage choice
        for action in actions:
            flag = RUN_FLAGS[action.dest]
            assert action.type is flag.type, (path, action.dest)
            assert action.choices == (None if flag.choices is None else list(flag.choices)), (path, action.dest)
            assert action.default == getattr(defaults, action.dest), (path, action.dest)
            assert action.help and "{default}" not in action.help, (path, action.dest)


def test_model_choices_are_the_model_sizes():
    # written out in node/cli/run_args.py so that parsing a command line does not import torch
    from node.train.model import MODEL_SIZES

    assert MODEL_SIZE_NAMES == tuple(MODEL_SIZES)
