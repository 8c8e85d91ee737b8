"""The dashboard at ``GET /`` in real headless Chromium, driven over the DevTools protocol.

A 3-node local swarm; the page of node 0 is loaded once and never reloaded. It must list every
node ONLINE and draw the epoch's paths; after a node is SIGKILLed the *same* page (its own
polling, no navigation) must drop it. A screenshot goes to ``tests/artifacts/`` (gitignored).
Skips, saying why, only when no Chromium is installed and none can be installed here.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from node.launch.process_swarm import ProcessSwarm
from tests.node.helpers import DEADLINE_S, poll, rpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--remote-debugging-port=0", "--remote-allow-origins=*", "--window-size=1100,900",
]  # fmt: skip
#: The node killed while the page is open: a stage-0 replica, so the swarm can still schedule.
VICTIM = 1
#: Seconds one DevTools command may take.
CDP_TIMEOUT_S = 30.0


def _find_browser() -> str | None:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture(scope="module")
def browser_path() -> str:
    path = _find_browser()
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                       capture_output=True, timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        path = _find_browser()
    if path is None:
        pytest.skip("no Chromium: not installed, and it cannot be installed here (needs root and apt-get)")
    return path


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = ProcessSwarm(3, (2, 1), base_dir=tmp_path_factory.mktemp("dash"), run_id="dash-run", heartbeat_s=1.0)
    s.start()
    try:
        yield s
    finally:
        s.stop()


class Page:
    """One Chromium tab over the DevTools websocket (trio_websocket, which py-libp2p brings)."""

    def __init__(self, ws_url: str):
        self.ws_url = ws_url

    def run(self, script) -> object:
        import trio
        from trio_websocket import open_websocket_url

        async def main():
            async with open_websocket_url(self.ws_url, max_message_size=64 * 2**20) as ws:
                counter = iter(range(1, 10**9))

                async def call(method: str, **params) -> dict:
                    ident = next(counter)
                    await ws.send_message(json.dumps({"id": ident, "method": method, "params": params}))
                    with trio.fail_after(CDP_TIMEOUT_S):
                        while True:
                            msg = json.loads(await ws.get_message())
                            if msg.get("id") == ident:
                                if "error" in msg:
                                    raise RuntimeError(f"{method}: {msg['error']}")
                                return msg["result"]

                return await script(call)

        return trio.run(main)


def _js(call, expression: str):
    async def go():
        result = await call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    return go()


@pytest.fixture(scope="module")
def page(browser_path, tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen([browser_path, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        poll(lambda: port_file.exists() and port_file.read_text().strip(), what="chromium DevTools port")
        port = int(port_file.read_text().split()[0])

        def page_target():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                targets = json.loads(resp.read())
            return next((t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"), None)

        yield Page(poll(page_target, what="a chromium page target"))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


GRID_JS = ("[...document.querySelectorAll('#grid [data-peer]')]"
           ".map(e => [e.dataset.peer, e.dataset.state, e.dataset.reachability, e.dataset.relay])")
STATE_JS = (
    "JSON.stringify({grid: " + GRID_JS + ", paths: document.querySelectorAll('#paths polyline.path').length,"
    " refreshes: Number(document.body.dataset.refreshes || 0), epoch: document.getElementById('epoch').textContent})"
)


def _page_state(page: Page) -> dict:
    async def script(call):
        return json.loads(await _js(call, STATE_JS) or "{}")

    return page.run(script)


def test_dashboard_shows_swarm_and_follows_a_kill(swarm, page):
    ids = {n.peer_id for n in swarm.nodes}
    for node in swarm.nodes:
        poll(lambda: {p["peer_id"] for p in rpc(node.rpc_url, "swarm")["peers"] if p["state"] == "ONLINE"} == ids,
             what=f"node {node.index} sees all nodes")  # fmt: skip
    url = swarm.nodes[0].rpc_url + "/"

    async def navigate(call):
        await call("Page.enable")
        await call("Page.navigate", url=url)

    page.run(navigate)

    def all_online_with_paths():
        state = _page_state(page)
        online = {peer for peer, st, *_ in state.get("grid", []) if st == "ONLINE"}
        return online == ids and state["paths"] > 0 and state

    before = poll(all_online_with_paths, what="the page lists every node ONLINE and draws the paths")

    def reachability_as_advertised():  # each node's reachability and relay role as the adverts say (polled)
        advertised = {p["peer_id"]: (p["reachability"], "relay" if p["relay"] else "")
                      for p in rpc(swarm.nodes[0].rpc_url, "swarm")["peers"]}
        shown = {peer: (reach, relay) for peer, _, reach, relay in _page_state(page).get("grid", [])}
        return shown == advertised and all(reach is not None for reach, _ in shown.values()) and advertised

    advertised = poll(reachability_as_advertised, what="the page shows each node's reachability and relay role")
    assert any(relay for _, relay in advertised.values()), advertised  # loopback nodes can be dialled: they relay
    ARTIFACTS.mkdir(exist_ok=True)

    async def screenshot(call):
        return (await call("Page.captureScreenshot", format="png"))["data"]

    (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(page.run(screenshot)))

    victim = swarm.nodes[VICTIM]
    swarm.kill(VICTIM, signal.SIGKILL)

    def victim_gone():
        state = _page_state(page)
        shown = {peer for peer, st, *_ in state.get("grid", []) if st != "OFFLINE"}
        return victim.peer_id not in shown and shown == ids - {victim.peer_id} and state

    after = poll(victim_gone, deadline_s=DEADLINE_S, what="the open page drops the killed node")
    assert after["refreshes"] > before["refreshes"]  # the same page, updated by its own polling
    (ARTIFACTS / "dashboard-after-kill.png").write_bytes(base64.b64decode(page.run(screenshot)))
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 1000
