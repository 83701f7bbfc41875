// roving dashboard: polls /api/state once a second and draws the views (plain DOM and inline SVG).
"use strict";
const COLORS = ["#2a7fd4", "#d9822b", "#3a9a4a", "#c33", "#8a5bd6", "#888"];
const opened = new Set();  // <details> the user opened, kept open across redraws
let last = null, lastText = "";

function esc(s) {
  return String(s == null ? "" : s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
}
function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString() : ""; }
function num(x, d) { return x == null ? "" : (typeof x === "number" ? x.toFixed(d == null ? 3 : d) : esc(x)); }

// A line chart: series = [{name, color, points: [[x, y], ...], dash}]
function lineChart(id, series, opts) {
  const W = opts.width || 460, H = opts.height || 180, L = 46, R = 10, T = 10, B = 28;
  const pts = series.flatMap(s => s.points).filter(p => p[1] != null && isFinite(p[1]));
  let svg = `<svg class="chart" id="${id}" width="${W}" height="${H}" data-points="${pts.length}" viewBox="0 0 ${W} ${H}">`;
  if (!pts.length) return svg + `<text x="${W / 2 - 30}" y="${H / 2}">no data yet</text></svg>`;
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(0, ...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (opts.ymin != null) y0 = Math.min(y0, opts.ymin);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + 1;
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg += `<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#999"/>`;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    svg += `<text x="2" y="${sy(y) + 3}">${+y.toPrecision(3)}</text><line x1="${L}" x2="${W - R}" y1="${sy(y)}" y2="${sy(y)}" stroke="#eee"/>`;
  }
  svg += `<text x="${L}" y="${H - 8}">${esc(opts.xfmt ? opts.xfmt(x0) : +x0.toPrecision(4))}</text>`;
  svg += `<text x="${W - R - 60}" y="${H - 8}">${esc(opts.xfmt ? opts.xfmt(x1) : +x1.toPrecision(4))}</text>`;
  svg += `<text x="${L + 80}" y="${H - 8}">${esc(opts.xlabel || "")}</text>`;
  series.forEach((s, i) => {
    const ok = s.points.filter(p => p[1] != null && isFinite(p[1]));
    if (!ok.length) return;
    const d = ok.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
    const c = s.color || COLORS[i % COLORS.length];
    svg += `<path d="${d}" fill="none" stroke="${c}" stroke-width="1.6" ${s.dash ? 'stroke-dasharray="4 3"' : ""} class="series" data-name="${esc(s.name)}"/>`;
    if (ok.length < 60) ok.forEach(p => { svg += `<circle cx="${sx(p[0]).toFixed(1)}" cy="${sy(p[1]).toFixed(1)}" r="2" fill="${c}"/>`; });
  });
  svg += "</svg>";
  const legend = series.map((s, i) => `<span><i style="background:${s.color || COLORS[i % COLORS.length]}"></i>${esc(s.name)}</span>`).join("");
  return `<div><div class="legend">${legend}</div>${svg}</div>`;
}

// predicted (simulator) and measured (stage processes' trace) kinds of work
const GANTT_COLORS = {"compute-fwd": "#2a7fd4", "fwd": "#2a7fd4", "compute-bwd": "#d9822b", "bwd": "#d9822b",
  "compute-loss": "#3a9a4a", "mb": "#3a9a4a", "sync": "#8a5bd6", "send": "#ccc"};
// A Gantt of one iteration: rows = [{name, bars: [[kind, label, start, end]]}], predicted and measured
function gantt(id, rows) {
  const W = 920, RH = 14, L = 110, H = rows.length * (RH + 4) + 30;
  const all = rows.flatMap(r => r.bars);
  let svg = `<svg class="chart" id="${id}" width="${W}" height="${H}" data-rows="${rows.length}" viewBox="0 0 ${W} ${H}">`;
  if (!all.length) return svg + `<text x="10" y="20">no plan yet</text></svg>`;
  const t0 = Math.min(...all.map(b => b[2])), t1 = Math.max(...all.map(b => b[3])) || 1;
  const sx = t => L + (t - t0) / (t1 - t0 || 1) * (W - L - 10);
  rows.forEach((r, i) => {
    const y = 4 + i * (RH + 4);
    svg += `<text x="2" y="${y + 11}">${esc(r.name)}</text>`;
    r.bars.forEach(b => {
      const c = GANTT_COLORS[b[0]] || "#aaa";
      svg += `<rect x="${sx(b[2]).toFixed(1)}" y="${y}" width="${Math.max(1, sx(b[3]) - sx(b[2])).toFixed(1)}" height="${RH}" fill="${c}" opacity="${r.predicted ? 0.45 : 0.95}"><title>${esc(b[0])} ${esc(b[1])}: ${num(b[2])}-${num(b[3])} s</title></rect>`;
    });
  });
  svg += `<text x="${L}" y="${H - 6}">${num(t0, 2)} s</text><text x="${W - 60}" y="${H - 6}">${num(t1, 2)} s</text></svg>`;
  return svg;
}

function details(key, summary, body) {
  return `<details data-key="${esc(key)}" ${opened.has(key) ? "open" : ""}><summary>${summary}</summary>${body}</details>`;
}

function eventItem(e) {
  const kind = e.kind || e.event, t = e.time ? clock(e.time) : (e.iteration != null ? "it " + e.iteration : "");
  let text = e.text || Object.entries(e).filter(([k, v]) => v != null && !["event", "iteration", "time_s", "kind"].includes(k))
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : typeof v === "number" && !Number.isInteger(v) ? +v.toPrecision(4) : v}`).join(" ");
  let tb = e.traceback ? details("tb" + e.seq, "traceback", `<pre>${esc(e.traceback)}</pre>`) : "";
  return `<li class="ev-${esc(kind)}" data-kind="${esc(kind)}"><span class="t">${esc(t)}</span><span class="k">${esc(kind)}</span>${esc(e.source ? e.source + ": " : "")}${esc(text)}${tb}</li>`;
}

function renderPools(rt) {
  if (!rt || !rt.pools.length) return '<p class="empty">No pool yet.</p>';
  return rt.pools.map(p => {
    const ws = p.workers || [], by = {};
    ws.forEach(w => { by[w.state] = (by[w.state] || 0) + 1; });
    const cnt = (k, label, cls) => `<div class="${cls || ""}"><b class="count-${k}" data-pool="${p.id}">${p[k] == null ? 0 : p[k]}</b>${label}</div>`;
    const evs = rt.events.filter(e => e.source === "pool " + p.id && ["worker-lost", "retry", "task-failed", "resize", "autoscale", "start-failed"].includes(e.kind));
    const table = ws.map(w => `<tr><td>${w.id}</td><td>${esc(w.name)}</td><td><span class="state s-${esc(w.state)}">${esc(w.state)}</span></td><td>${w.items}</td></tr>`).join("");
    return `<div class="card pool" id="pool-${p.id}" data-state="${esc(p.state)}"><h2>Pool ${p.id} <span class="state s-${p.state === "gone" ? "gone" : "running"}">${esc(p.state)}</span>
      <small>${p.size != null ? `${p.size} worker(s) wanted (${p.min}-${p.max})` : ""}</small></h2>
      <div class="counts">${cnt("queued", "queued")}${cnt("running", "running")}${cnt("done", "done")}${cnt("failed", "failed", "bad")}${cnt("retried", "retried", "warn")}${cnt("lost", "workers lost", "bad")}</div>
      <div class="counts">${["idle", "busy", "starting", "retiring"].map(s => `<div><b class="workers-${s}">${by[s] || 0}</b>${s}</div>`).join("")}</div>
      <div class="charts">${lineChart("throughput-" + p.id, [{name: "items/s", points: (p.throughput || []).map(q => [q[0], q[1]])}], {xfmt: clock, xlabel: "throughput"})}
      <div style="flex:1;min-width:300px"><table><tr><th>worker</th><th>process</th><th>state</th><th>items</th></tr>${table}</table></div></div>
      <h3>Losses, retries, failures, resizes</h3><ol class="events pool-events">${evs.slice(-30).reverse().map(eventItem).join("") || '<li class="empty">none</li>'}</ol></div>`;
  }).join("");
}

function renderProcesses(rt) {
  if (!rt || !rt.processes.length) return '<p class="empty">No process yet.</p>';
  const rows = rt.processes.slice().reverse().map(p => {
    const res = Object.entries(p.resources || {}).filter(([, v]) => v != null).map(([k, v]) => `${k}=${v}`).join(" ");
    const out = p.output.length ? details("out-" + p.name, `${p.output.length} line(s)`, `<pre>${esc(p.output.slice(-40).join("\n"))}</pre>`) : "";
    return `<tr class="proc" data-name="${esc(p.name)}" data-state="${esc(p.state)}"><td>${esc(p.name)}</td><td>${esc(p.backend)}</td><td>${esc(p.host)}</td><td>${esc(p.job)}</td>
      <td><span class="state s-${esc(p.state)}">${esc(p.state)}</span></td><td>${esc(res)}</td><td>${clock(p.started)}</td>
      <td>${p.exitcode == null ? "" : p.exitcode}</td><td>${esc(p.cause)}</td><td>${out}</td></tr>`;
  }).join("");
  return `<div class="card"><table><tr><th>name</th><th>backend</th><th>host</th><th>job</th><th>state</th><th>resources</th><th>started</th><th>exit</th><th>cause</th><th>output</th></tr>${rows}</table></div>`;
}

function renderPipeline(run, i) {
  const st = run.status || {}, its = run.iterations || [];
  const nodes = run.nodes.map(n => `<tr class="node" data-node="${esc(n.name)}" data-state="${esc(n.state)}"><td>${esc(n.name)}</td><td>${n.stage == null ? "" : n.stage}</td><td>${esc(n.host)}</td><td><span class="state s-${esc(n.state)}">${esc(n.state)}</span></td></tr>`).join("");
  const loss = lineChart("loss-" + i, [{name: "training loss", points: its.map(r => [r.iteration, r.train_loss])},
    {name: "validation loss", points: (run.evaluations || []).map(r => [r.iteration, r.val_loss != null ? r.val_loss : r.loss]), color: "#3a9a4a"}], {xlabel: "iteration"});
  const time = lineChart("itime-" + i, [{name: "measured s", points: its.map(r => [r.iteration, r.seconds])},
    {name: "predicted s", points: its.map(r => [r.iteration, r.predicted_with_sync_seconds != null ? r.predicted_with_sync_seconds : r.predicted_seconds]), dash: true, color: "#d9822b"}], {xlabel: "iteration", ymin: 0});
  let plan = "";
  if (run.plan && (run.plan.predicted || run.plan.measured)) {
    const rows = [];
    const names = [...new Set([...Object.keys(run.plan.predicted || {}), ...Object.keys(run.plan.measured || {})])].sort();
    names.forEach(n => {
      if (run.plan.predicted && run.plan.predicted[n]) rows.push({name: n + " plan", predicted: true, bars: run.plan.predicted[n]});
      if (run.plan.measured && run.plan.measured[n]) rows.push({name: n + " real", bars: run.plan.measured[n]});
    });
    plan = `<h3>Plan of iteration ${run.plan.iteration == null ? "" : run.plan.iteration}: predicted (light) and measured (dark); forward blue, backward orange, first stage and loss green, replica sync violet</h3>${gantt("gantt-" + i, rows)}`;
  }
  const evs = (run.events || []).slice(-60).reverse().map(eventItem).join("");
  return `<div class="card pipeline" data-finished="${run.finished}"><h2>Training ${esc(run.control || run.metrics)} <small>${st.iterations_done != null ? `${st.iterations_done}/${st.iterations} iterations` : `${its.length} iterations`}${run.finished ? " (finished)" : ""}</small></h2>
    <div class="charts">${loss}${time}</div>
    <div class="charts"><div style="min-width:320px"><h3>Nodes</h3><table><tr><th>node</th><th>stage</th><th>region</th><th>state</th></tr>${nodes}</table>
    ${st.missing_stages && st.missing_stages.length ? `<p>missing stages: ${esc(st.missing_stages)}</p>` : ""}</div>
    <div style="flex:1;min-width:320px"><h3>Events</h3><ol class="events pipeline-events">${evs || '<li class="empty">none</li>'}</ol></div></div>${plan}</div>`;
}

function render(s) {
  last = s;
  const rt = s.runtime, view = (document.querySelector("nav button.on") || {dataset: {}}).dataset.view;
  // only the view in sight is drawn (the others when shown): less work for the browser
  if (view === "pools") document.getElementById("pools").innerHTML = renderPools(rt);
  if (view === "processes") document.getElementById("processes").innerHTML = renderProcesses(rt);
  if (view === "pipeline") document.getElementById("pipelines").innerHTML = s.pipelines.length ? s.pipelines.map(renderPipeline).join("") : '<p class="empty">No pipeline training watched.</p>';
  if (view === "events") {
    const evs = (rt ? rt.events : []).slice(-300).reverse();
    document.getElementById("events").innerHTML = evs.map(eventItem).join("") || '<li class="empty">No event yet.</li>';
  }
  document.getElementById("clock").textContent = "updated " + clock(s.time);
  document.body.dataset.updated = String(s.time);
}

function show(view) {
  document.querySelectorAll("nav button").forEach(b => b.classList.toggle("on", b.dataset.view === view));
  document.querySelectorAll(".view").forEach(v => v.classList.toggle("on", v.id === "view-" + view));
  history.replaceState(null, "", location.pathname + location.search + "#" + view);
  if (last) render(last);
}

async function poll() {
  try {
    const r = await fetch("/api/state" + location.search, {credentials: "same-origin", cache: "no-store"});
    if (r.ok) {
      const text = await r.text(), same = text.replace(/"time": [0-9.e+]+/g, "");
      if (same !== lastText) { lastText = same; render(JSON.parse(text)); }  // nothing new: nothing drawn
      else document.getElementById("clock").textContent = "updated " + clock(Date.now() / 1000);
    } else document.getElementById("clock").textContent = "error " + r.status;
  } catch (e) {
    document.getElementById("clock").textContent = "program not reachable (ended?)";
  }
  setTimeout(poll, 1000);
}

document.getElementById("tabs").addEventListener("click", e => { if (e.target.dataset.view) show(e.target.dataset.view); });
document.addEventListener("toggle", e => {
  const k = e.target.dataset && e.target.dataset.key;
  if (k) { if (e.target.open) opened.add(k); else opened.delete(k); }
}, true);
const start = location.hash.slice(1);
if (["pools", "processes", "pipeline", "events"].includes(start)) show(start);
poll();
