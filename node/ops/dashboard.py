"""The built-in web dashboard served at ``GET /`` of the daemon's local HTTP endpoint.

One static page (HTML + vanilla JS in this module: no build step, no extra files to package)
that polls the node's own JSON RPC endpoints every :data:`POLL_INTERVAL_MS`:

* ``/swarm``: stages x nodes grid with live states;
* ``/schedule``: the current epoch's paths, drawn like Figure 1 of the SkipPipe paper (data
  nodes in the left column, one column per stage, one coloured polyline per path);
* ``/iterations``: loss curve of recent iterations (filled by the trainer via NodeMetrics);
* ``/traffic``: data-plane bytes per peer, turned into per-node throughput between polls.

It only talks to the node that serves it (same origin), so the endpoint needs no CORS headers
and stays loopback-only.
"""

from __future__ import annotations

__all__ = ["DASHBOARD_HTML", "POLL_INTERVAL_MS", "dashboard_html"]

#: How often the page refreshes its data (the brief asks for 1-2 s).
POLL_INTERVAL_MS = 1500

DASHBOARD_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>SkipPipe swarm</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; background: #fafafa; }
  h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 18px 0 6px; }
  .sub { color: #666; }
  table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 4px 8px; vertical-align: top; }
  th { background: #eee; }
  .node { display: inline-block; margin: 2px; padding: 2px 6px; border-radius: 4px; font-family: monospace; font-size: 12px; }
  .ONLINE { background: #c8f0c8; } .JOINING { background: #fff1b8; } .DRAINING { background: #ffd8a8; }
  .OFFLINE { background: #f4c0c0; } .self { outline: 2px solid #333; }
  svg { background: #fff; border: 1px solid #ddd; }
  #error { color: #b00; }
  .row { display: flex; gap: 24px; flex-wrap: wrap; }
</style>
</head>
<body>
<h1>SkipPipe swarm <span id="run" class="sub"></span></h1>
<div class="sub">node <span id="self"></span> &middot; state <span id="state"></span> &middot;
  epoch <span id="epoch">-</span> &middot; <span id="coord"></span> &middot; updated <span id="updated">never</span>
  <span id="error"></span></div>
<h2>Stages &times; nodes</h2>
<table id="grid"><tbody></tbody></table>
<div class="row">
  <div><h2>Paths of the current epoch</h2><svg id="paths" width="640" height="260"></svg></div>
  <div><h2>Loss</h2><svg id="loss" width="420" height="260"></svg></div>
</div>
<h2>Throughput per node (data plane, seen from this node)</h2>
<table id="traffic"><thead><tr><th>peer</th><th>in B/s</th><th>out B/s</th><th>microbatches in</th><th>microbatches out</th></tr></thead><tbody></tbody></table>
<div class="sub" id="tokens"></div>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#e377c2", "#8c564b", "#bcbd22", "#7f7f7f"];
const SVGNS = "http://www.w3.org/2000/svg";
let lastTraffic = null;

async function get(method) {
  const r = await fetch("/" + method, {cache: "no-store"});
  const body = await r.json();
  if (!body.ok) throw new Error(method + ": " + body.error);
  return body.result;
}
function short(id) { return id ? id.slice(0, 6) + "\u2026" + id.slice(-4) : "?"; }
function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function drawGrid(swarm, numStages) {
  const tbody = document.querySelector("#grid tbody");
  tbody.replaceChildren();
  const stages = Math.max(numStages || 0, ...swarm.peers.map(p => Math.max(-1, ...p.stages) + 1));
  for (let s = 0; s < stages; s++) {
    const tr = el("tr");
    tr.appendChild(el("th", {}, s === 0 ? "stage 0 (data)" : "stage " + s));
    const td = el("td");
    for (const p of swarm.peers.filter(p => p.stages.includes(s))) {
      const cls = "node " + p.state + (p.peer_id === swarm.self ? " self" : "");
      const reach = p.reachability || "unknown";  // direct / relayed / outbound-only: who can dial it
      const relay = p.relay ? "relay" : "";  // forwards data-plane frames between members behind NAT
      const span = el("span", {class: cls, title: p.peer_id + " (" + p.state + ", " + reach + ", seen " + p.age_s + " s ago)",
                               "data-peer": p.peer_id, "data-state": p.state, "data-reachability": reach,
                               "data-relay": relay},
                      short(p.peer_id) + " " + p.state + " \u00b7 " + reach + (relay ? " \u00b7 +relay" : ""));
      td.appendChild(span);
    }
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

function drawPaths(sched, swarm) {
  const svg = document.getElementById("paths");
  svg.replaceChildren();
  const s = sched && sched.schedule;
  if (!s) { svg.appendChild(el("svg:text", {x: 20, y: 30}, "no schedule yet: " + (sched ? sched.status : ""))); return; }
  const colW = 600 / Math.max(1, s.stages.length), rowH = 220 / Math.max(1, ...s.stages.map(c => c.length));
  const pos = {}, behindNat = {};
  (swarm ? swarm.peers : []).forEach(p => { behindNat[p.peer_id] = p.reachability === "outbound_only"; });
  s.stages.forEach((nodes, stage) => nodes.forEach((v, i) => { pos[v] = [30 + stage * colW, 30 + i * rowH + rowH / 2]; }));
  s.stages.forEach((nodes, stage) => svg.appendChild(el("svg:text", {x: 30 + stage * colW - 12, y: 16, "font-size": 11},
                                                        stage === 0 ? "data" : "stage " + stage)));
  s.paths.forEach((path, k) => {
    const off = (k % 5 - 2) * 3;
    const pts = path.route.concat([path.route[0]]).map((v, i, all) => {
      const [x, y] = pos[v] || [0, 0];
      return (i === all.length - 1 ? x + 4 : x) + "," + (y + off);
    });
    svg.appendChild(el("svg:polyline", {points: pts.join(" "), fill: "none", stroke: COLORS[k % COLORS.length],
                                        "stroke-width": 2, "stroke-opacity": 0.8, class: "path"}));
    // a hop between two members nobody can dial goes through a relay: drawn dashed over the path
    path.route.forEach((v, i) => {
      const w = path.route[(i + 1) % path.route.length];
      if (behindNat[sched.members[v]] && behindNat[sched.members[w]]) {
        const [x1, y1] = pos[v] || [0, 0], [x2, y2] = pos[w] || [0, 0];
        svg.appendChild(el("svg:line", {x1: x1, y1: y1 + off, x2: x2, y2: y2 + off, stroke: "#000",
                                        "stroke-dasharray": "4 3", class: "relayed"}));
      }
    });
  });
  for (const [v, [x, y]] of Object.entries(pos)) {
    const peer = sched.members[v];
    svg.appendChild(el("svg:circle", {cx: x, cy: y, r: 9, fill: "#fff", stroke: "#333", "data-peer": peer}));
    svg.appendChild(el("svg:text", {x: x + 12, y: y + 4, "font-size": 10}, short(peer)));
  }
}

function drawLoss(data) {
  const svg = document.getElementById("loss");
  svg.replaceChildren();
  const pts = data.iterations.filter(r => r.loss !== null && r.loss !== undefined);
  if (!pts.length) { svg.appendChild(el("svg:text", {x: 20, y: 30}, "no iterations reported yet")); return; }
  const xs = pts.map(r => r.iteration), ys = pts.map(r => r.loss);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const line = pts.map(r => (40 + (r.iteration - x0) / (x1 - x0) * 360) + "," + (230 - (r.loss - y0) / (y1 - y0) * 200));
  svg.appendChild(el("svg:polyline", {points: line.join(" "), fill: "none", stroke: "#1f77b4", "stroke-width": 2}));
  svg.appendChild(el("svg:text", {x: 2, y: 34, "font-size": 10}, y1.toFixed(3)));
  svg.appendChild(el("svg:text", {x: 2, y: 232, "font-size": 10}, y0.toFixed(3)));
  svg.appendChild(el("svg:text", {x: 40, y: 252, "font-size": 10}, "iteration " + x0 + " \u2026 " + x1));
}

function drawTraffic(traffic, iterations) {
  const tbody = document.querySelector("#traffic tbody");
  tbody.replaceChildren();
  const now = Date.now() / 1000;
  const dt = lastTraffic ? Math.max(1e-3, now - lastTraffic.t) : null;
  for (const [peer, t] of Object.entries(traffic.peers)) {
    const prev = lastTraffic && lastTraffic.peers[peer];
    const rate = k => dt && prev ? ((t[k] - prev[k]) / dt).toFixed(0) : "-";
    const tr = el("tr", {"data-peer": peer});
    [short(peer), rate("bytes_in"), rate("bytes_out"), t.microbatches_in, t.microbatches_out]
      .forEach(v => tr.appendChild(el("td", {}, String(v))));
    tbody.appendChild(tr);
  }
  lastTraffic = {t: now, peers: traffic.peers};
  const last = iterations.iterations[iterations.iterations.length - 1];
  document.getElementById("tokens").textContent = last && last.tokens_per_s !== null && last.tokens_per_s !== undefined
    ? "this node: " + Number(last.tokens_per_s).toFixed(0) + " tokens/s at iteration " + last.iteration : "";
}

async function refresh() {
  try {
    const [status, swarm, sched, iters, traffic] = await Promise.all(
      ["status", "swarm", "schedule", "iterations", "traffic"].map(get));
    document.getElementById("run").textContent = "run " + status.run_id;
    document.getElementById("self").textContent = status.peer_id;
    document.getElementById("state").textContent = status.state;
    document.getElementById("epoch").textContent = sched.epoch === null ? "-" : sched.epoch;
    document.getElementById("coord").textContent = sched.status || "";
    drawGrid(swarm, status.run && status.run.num_stages);
    drawPaths(sched, swarm);
    drawLoss(iters);
    drawTraffic(traffic, iters);
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    document.getElementById("error").textContent = "";
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (e) {
    document.getElementById("error").textContent = " (" + e.message + ")";
  }
}
refresh();
setInterval(refresh, POLL_MS);
</script>
</body>
</html>
"""


def dashboard_html(poll_interval_ms: int = POLL_INTERVAL_MS) -> bytes:
    """The page with its poll interval filled in."""
    return DASHBOARD_HTML.replace("__POLL_MS__", str(int(poll_interval_ms))).encode()
