"""A harness process for the orphan test: starts a local swarm through the process harness, then idles.

``python -m tests.node.orphan_harness BASE_DIR N``: N daemons via :class:`node.launch.process_swarm.ProcessSwarm`;
when they are all up it writes their pids to ``BASE_DIR/pids.json`` and sleeps until it is killed (the
test SIGKILLs it, so nothing of ProcessSwarm's own clean-up runs).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from node.launch.process_swarm import ProcessSwarm

if __name__ == "__main__":
    base, n = Path(sys.argv[1]), int(sys.argv[2])
    swarm = ProcessSwarm(n, base_dir=base / "swarm", heartbeat_s=1.0)
    swarm.start(timeout=240)
    tmp = base / "pids.json.tmp"
    tmp.write_text(json.dumps([node.proc.pid for node in swarm.nodes]))
    tmp.replace(base / "pids.json")
    while True:
        time.sleep(1)
