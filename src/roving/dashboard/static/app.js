// roving dashboard: polls /api/state once a second and draws the views (plain DOM and inline SVG).
// Every value shown goes through html`...`: what is interpolated is escaped (text, and inside quoted
// attributes), unless it is itself made by html`...`; nothing from the program reaches the page as markup.
"use strict";
const COLORS = ["#2a7fd4", "#d9822b", "#3a9a4a", "#c33", "#8a5bd6", "#888"];
const opened = new Set();  // <details> the user opened, kept open across redraws
let last = null, lastText = "";

class Markup { constructor(s) { this.s = s; } toString() { return this.s; } }
function esc(s) {
  return String(s == null ? "" : s).replace(/[&<>"'`]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;", "`": "&#96;"})[c]);
}
function piece(v) { return v instanceof Markup ? v.s : Array.isArray(v) ? v.map(piece).join("") : esc(v); }
function html(strings, ...values) {
  let out = strings[0];
  values.forEach((v, i) => { out += piece(v) + strings[i + 1]; });
  return new Markup(out);
}
function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString() : ""; }
function num(x, d) { return x == null ? "" : (typeof x === "number" ? x.toFixed(d == null ? 3 : d) : String(x)); }

// A line chart: series = [{name, color, points: [[x, y], ...], dash}]
function lineChart(id, series, opts) {
  const W = opts.width || 460, H = opts.height || 180, L = 46, R = 10, T = 10, B = 28;
  const pts = series.flatMap(s => s.points).filter(p => typeof p[0] === "number" && typeof p[1] === "number" && isFinite(p[1]));
  const open = html`<svg class="chart" id="${id}" width="${W}" height="${H}" data-points="${pts.length}" viewBox="0 0 ${W} ${H}">`;
  if (!pts.length) return html`${open}<text x="${W / 2 - 30}" y="${H / 2}">no data yet</text></svg>`;
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(0, ...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (opts.ymin != null) y0 = Math.min(y0, opts.ymin);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + 1;
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  const parts = [open, html`<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#999"/>`];
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    parts.push(html`<text x="2" y="${sy(y) + 3}">${+y.toPrecision(3)}</text><line x1="${L}" x2="${W - R}" y1="${sy(y)}" y2="${sy(y)}" stroke="#eee"/>`);
  }
  parts.push(html`<text x="${L}" y="${H - 8}">${opts.xfmt ? opts.xfmt(x0) : +x0.toPrecision(4)}</text>`);
  parts.push(html`<text x="${W - R - 60}" y="${H - 8}">${opts.xfmt ? opts.xfmt(x1) : +x1.toPrecision(4)}</text>`);
  parts.push(html`<text x="${L + 80}" y="${H - 8}">${opts.xlabel || ""}</text>`);
  series.forEach((s, i) => {
    const ok = s.points.filter(p => typeof p[0] === "number" && typeof p[1] === "number" && isFinite(p[1]));
    if (!ok.length) return;
    const d = ok.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
    const c = s.color || COLORS[i % COLORS.length];
    parts.push(html`<path d="${d}" fill="none" stroke="${c}" stroke-width="1.6" stroke-dasharray="${s.dash ? "4 3" : "none"}" class="series" data-name="${s.name}"/>`);
    if (ok.length < 60) ok.forEach(p => { parts.push(html`<circle cx="${sx(p[0]).toFixed(1)}" cy="${sy(p[1]).toFixed(1)}" r="2" fill="${c}"/>`); });
  });
  // the legend's swatches are SVG (the page's policy allows no inline style)
  const legend = series.map((s, i) => html`<span><svg width="12" height="5"><rect width="12" height="5" fill="${s.color || COLORS[i % COLORS.length]}"/></svg> ${s.name}</span>`);
  return html`<div><div class="legend">${legend}</div>${parts}</svg></div>`;
}

// predicted (simulator) and measured (stage processes' trace) kinds of work
const GANTT_COLORS = {"compute-fwd": "#2a7fd4", "fwd": "#2a7fd4", "compute-bwd": "#d9822b", "bwd": "#d9822b",
  "compute-loss": "#3a9a4a", "mb": "#3a9a4a", "sync": "#8a5bd6", "send": "#ccc"};
// A Gantt of one iteration: rows = [{name, bars: [[kind, label, start, end]]}], predicted and measured
function gantt(id, rows) {
  const W = 920, RH = 14, L = 110, H = rows.length * (RH + 4) + 30;
  const bar = b => Array.isArray(b) && typeof b[2] === "number" && typeof b[3] === "number";
  const all = rows.flatMap(r => r.bars).filter(bar);
  const open = html`<svg class="chart" id="${id}" width="${W}" height="${H}" data-rows="${rows.length}" viewBox="0 0 ${W} ${H}">`;
  if (!all.length) return html`${open}<text x="10" y="20">no plan yet</text></svg>`;
  const t0 = Math.min(...all.map(b => b[2])), t1 = Math.max(...all.map(b => b[3])) || 1;
  const sx = t => L + (t - t0) / (t1 - t0 || 1) * (W - L - 10);
  const parts = [open];
  rows.forEach((r, i) => {
    const y = 4 + i * (RH + 4);
    parts.push(html`<text x="2" y="${y + 11}">${r.name}</text>`);
    r.bars.filter(bar).forEach(b => {
      const c = GANTT_COLORS[b[0]] || "#aaa";
      parts.push(html`<rect x="${sx(b[2]).toFixed(1)}" y="${y}" width="${Math.max(1, sx(b[3]) - sx(b[2])).toFixed(1)}" height="${RH}" fill="${c}" opacity="${r.predicted ? 0.45 : 0.95}"><title>${b[0]} ${b[1]}: ${num(b[2])}-${num(b[3])} s</title></rect>`);
    });
  });
  parts.push(html`<text x="${L}" y="${H - 6}">${num(t0, 2)} s</text><text x="${W - 60}" y="${H - 6}">${num(t1, 2)} s</text></svg>`);
  return html`${parts}`;
}

function details(key, summary, body) {
  return opened.has(key) ? html`<details data-key="${key}" open><summary>${summary}</summary>${body}</details>`
    : html`<details data-key="${key}"><summary>${summary}</summary>${body}</details>`;
}

function eventItem(e) {
  const kind = e.kind || e.event, t = e.time ? clock(e.time) : (e.iteration != null ? "it " + e.iteration : "");
  const text = e.text || Object.entries(e).filter(([k, v]) => v != null && !["event", "iteration", "time_s", "kind"].includes(k))
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : typeof v === "number" && !Number.isInteger(v) ? +v.toPrecision(4) : v}`).join(" ");
  const tb = e.traceback ? details("tb" + e.seq, "traceback", html`<pre>${e.traceback}</pre>`) : "";
  return html`<li class="ev-${kind}" data-kind="${kind}"><span class="t">${t}</span><span class="k">${kind}</span>${e.source ? e.source + ": " : ""}${text}${tb}</li>`;
}

function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toPrecision(3) : n} ${units[i]}`;
}

function renderPools(rt) {
  if (!rt || !rt.pools.length) return html`<p class="empty">No pool yet.</p>`;
  return html`${rt.pools.map(p => {
    const ws = p.workers || [], by = {};
    ws.forEach(w => { by[w.state] = (by[w.state] || 0) + 1; });
    const cnt = (k, label, cls) => html`<div class="${cls || ""}"><b class="count-${k}" data-pool="${p.id}">${p[k] == null ? 0 : p[k]}</b>${label}</div>`;
    const evs = rt.events.filter(e => e.source === "pool " + p.id && ["worker-lost", "retry", "task-failed", "resize", "autoscale", "start-failed", "memory-restart"].includes(e.kind));
    const table = ws.map(w => html`<tr><td>${w.id}</td><td>${w.name}</td><td><span class="state s-${w.state}">${w.state}</span></td><td>${w.items}</td>
      <td class="memory">${bytes(w.memory)}</td><td class="peak-memory">${bytes(w.peak_memory)}</td><td>${bytes(w.memory_limit)}</td></tr>`);
    const calls = (p.calls || []).slice(-10).reverse().map(c => html`<tr class="call-peak"><td>${c.call}</td><td>${c.name}</td><td class="peak-memory">${bytes(c.peak_memory)}</td></tr>`);
    return html`<div class="card pool" id="pool-${p.id}" data-state="${p.state}"><h2>Pool ${p.id} <span class="state s-${p.state === "gone" ? "gone" : "running"}">${p.state}</span>
      <small>${p.size != null ? `${p.size} worker(s) wanted (${p.min}-${p.max})` : ""}</small></h2>
      <div class="counts">${cnt("queued", "queued")}${cnt("running", "running")}${cnt("done", "done")}${cnt("failed", "failed", "bad")}${cnt("retried", "retried", "warn")}${cnt("lost", "workers lost", "bad")}${cnt("oom_kills", "killed for memory", "bad")}${cnt("memory_restarts", "memory restarts", "warn")}</div>
      <div class="counts">${["idle", "busy", "starting", "retiring"].map(s => html`<div><b class="workers-${s}">${by[s] || 0}</b>${s}</div>`)}</div>
      <div class="charts">${lineChart("throughput-" + p.id, [{name: "items/s", points: (p.throughput || []).map(q => [q[0], q[1]])}], {xfmt: clock, xlabel: "throughput"})}
      <div class="wide"><table><tr><th>worker</th><th>process</th><th>state</th><th>items</th><th>memory</th><th>peak memory</th><th>limit</th></tr>${table}</table>
      ${calls.length ? html`<table class="call-peaks"><tr><th>call</th><th>function</th><th>peak memory</th></tr>${calls}</table>` : ""}</div></div>
      <h3>Losses, retries, failures, resizes</h3><ol class="events pool-events">${evs.length ? evs.slice(-30).reverse().map(eventItem) : html`<li class="empty">none</li>`}</ol></div>`;
  })}`;
}

function renderProcesses(rt) {
  if (!rt || !rt.processes.length) return html`<p class="empty">No process yet.</p>`;
  const rows = rt.processes.slice().reverse().map(p => {
    const res = Object.entries(p.resources || {}).filter(([, v]) => v != null).map(([k, v]) => `${k}=${v}`).join(" ");
    const out = p.output.length ? details("out-" + p.name, `${p.output.length} line(s)`, html`<pre>${p.output.slice(-40).join("\n")}</pre>`) : "";
    return html`<tr class="proc" data-name="${p.name}" data-state="${p.state}"><td>${p.name}</td><td>${p.backend}</td><td>${p.host}</td><td>${p.job}</td>
      <td><span class="state s-${p.state}">${p.state}</span></td><td>${res}</td><td>${clock(p.started)}</td>
      <td>${p.exitcode == null ? "" : p.exitcode}</td><td>${p.cause}</td><td>${out}</td></tr>`;
  });
  return html`<div class="card"><table><tr><th>name</th><th>backend</th><th>host</th><th>job</th><th>state</th><th>resources</th><th>started</th><th>exit</th><th>cause</th><th>output</th></tr>${rows}</table></div>`;
}

function renderPipeline(run, i) {
  const st = run.status || {}, its = run.iterations || [];
  const nodes = run.nodes.map(n => html`<tr class="node" data-node="${n.name}" data-state="${n.state}"><td>${n.name}</td><td>${n.stage == null ? "" : n.stage}</td><td>${n.host}</td><td><span class="state s-${n.state}">${n.state}</span></td></tr>`);
  const loss = lineChart("loss-" + i, [{name: "training loss", points: its.map(r => [r.iteration, r.train_loss])},
    {name: "validation loss", points: (run.evaluations || []).map(r => [r.iteration, r.val_loss != null ? r.val_loss : r.loss]), color: "#3a9a4a"}], {xlabel: "iteration"});
  const time = lineChart("itime-" + i, [{name: "measured s", points: its.map(r => [r.iteration, r.seconds])},
    {name: "predicted s", points: its.map(r => [r.iteration, r.predicted_with_sync_seconds != null ? r.predicted_with_sync_seconds : r.predicted_seconds]), dash: true, color: "#d9822b"}], {xlabel: "iteration", ymin: 0});
  let plan = "";
  if (run.plan && (run.plan.predicted || run.plan.measured)) {
    const rows = [];
    const names = [...new Set([...Object.keys(run.plan.predicted || {}), ...Object.keys(run.plan.measured || {})])].sort();
    names.forEach(n => {
      if (run.plan.predicted && Array.isArray(run.plan.predicted[n])) rows.push({name: n + " plan", predicted: true, bars: run.plan.predicted[n]});
      if (run.plan.measured && Array.isArray(run.plan.measured[n])) rows.push({name: n + " real", bars: run.plan.measured[n]});
    });
    plan = html`<h3>Plan of iteration ${run.plan.iteration == null ? "" : run.plan.iteration}: predicted (light) and measured (dark); forward blue, backward orange, first stage and loss green, replica sync violet</h3>${gantt("gantt-" + i, rows)}`;
  }
  const evs = (run.events || []).slice(-60).reverse().map(eventItem);
  const missing = st.missing_stages && st.missing_stages.length ? html`<p>missing stages: ${st.missing_stages}</p>` : "";
  return html`<div class="card pipeline" data-finished="${run.finished}"><h2>Training ${run.control || run.metrics} <small>${st.iterations_done != null ? `${st.iterations_done}/${st.iterations} iterations` : `${its.length} iterations`}${run.finished ? " (finished)" : ""}</small></h2>
    <div class="charts">${loss}${time}</div>
    <div class="charts"><div class="column"><h3>Nodes</h3><table><tr><th>node</th><th>stage</th><th>region</th><th>state</th></tr>${nodes}</table>
    ${missing}</div>
    <div class="wide column"><h3>Events</h3><ol class="events pipeline-events">${evs.length ? evs : html`<li class="empty">none</li>`}</ol></div></div>${plan}</div>`;
}

function render(s) {
  last = s;
  const rt = s.runtime, view = (document.querySelector("nav button.on") || {dataset: {}}).dataset.view;
  // only the view in sight is drawn (the others when shown): less work for the browser
  const draw = (id, markup) => { document.getElementById(id).innerHTML = markup.s; };
  if (view === "pools") draw("pools", renderPools(rt));
  if (view === "processes") draw("processes", renderProcesses(rt));
  if (view === "pipeline") draw("pipelines", s.pipelines.length ? html`${s.pipelines.map(renderPipeline)}` : html`<p class="empty">No pipeline training watched.</p>`);
  if (view === "events") {
    const evs = (rt ? rt.events : []).slice(-300).reverse();
    draw("events", evs.length ? html`${evs.map(eventItem)}` : html`<li class="empty">No event yet.</li>`);
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
