"""Small shared helpers of the harnesses and the daemon: tables, /proc scans, the training poller, states."""

import json
import logging
import subprocess
import sys
import time
import uuid

from node.ops.tables import text_table
from node.swarm.states import NodeLogger, NodeState
from node.launch.process_swarm import ProcessNode, training_state
from node.launch.procs import process_group_members, processes_mentioning


def test_text_table_aligns_labels_left_and_numbers_right():
    out = text_table([["name", "value"], ["a", "1"], ["long name", "22"]]).splitlines()
    assert out == ["name       value", "---------  -----", "a              1", "long name     22"]


def test_node_logger_prefixes_the_node_once_it_is_known(caplog):
    log = NodeLogger(logging.getLogger("tests.harness"))
    with caplog.at_level(logging.INFO, logger="tests.harness"):
        log.info("before %d", 1)
        log.set_node("abcd1234")
        log.info("after %d", 2)
    assert [r.getMessage() for r in caplog.records] == ["before 1", "[abcd1234] after 2"]


def test_node_state_is_its_name_on_the_wire():
    assert NodeState.ONLINE == "ONLINE" and str(NodeState.DRAINING) == "DRAINING"
    assert json.dumps({"state": NodeState.OFFLINE}) == '{"state": "OFFLINE"}'


def test_proc_scans_find_a_child_by_group_and_by_command_line():
    marker = f"marker-{uuid.uuid4().hex}"
    child = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(30)", marker],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while child.pid not in processes_mentioning(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_mentioning(marker) == [child.pid]
        assert process_group_members(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert processes_mentioning(marker) == [] and process_group_members(child.pid) == []


def test_training_state_of_a_node_that_is_not_running_is_none(tmp_path):
    assert training_state(ProcessNode(index=0, stage=0, workdir=tmp_path, args=[])) is None
