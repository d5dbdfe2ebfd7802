// The KV cache dashboard: frames (LLMEngine.kv_snapshot as JSON) from /dashboard/events, or from a trace that
// `pagedllm replay` serves, applied to one picture of the pool and drawn on canvases. No build step, no library.
// The page's whole state is window.dashboardState (tests read it).
"use strict";

const STATES = ["free", "used", "shared", "cached", "reserved", "restored", "adapter"];
const COLORS = { free: "#e6e9ee", used: "#4c78a8", shared: "#f58518", cached: "#54a24b", reserved: "#eeca3b",
                 restored: "#17becf", adapter: "#b279a2" };
const SHARED_SHADES = ["#f8a145", "#f58518", "#d9650a", "#a94b05"]; // ref count 2, 3-4, 5-8, more
const EVENT_TEXT = {
  cow: (e) => `copy-on-write: block ${e.blocks[0]} → ${e.blocks[1]}`,
  fork: (e) => `fork: a sample shares ${e.blocks.length} block${e.blocks.length === 1 ? "" : "s"}`,
  preempt: (e) => `preempted: ${e.blocks.length} block${e.blocks.length === 1 ? "" : "s"} let go`,
  prefix_hit: (e) => `prefix-cache hit: ${e.tokens} tokens in ${e.blocks.length} blocks`,
  evict: (e) => `evicted the cached prefix of block ${e.blocks[0]}`,
  reset: (e) => `prefix cache reset: ${e.blocks.length} blocks forgotten`,
  restore: (e) => `restored from the KV tier: ${e.tokens} tokens in ${e.blocks.length} blocks`,
  adapter_load: (e) => `LoRA adapter ${e.seq_id} loaded: its weights take ${e.blocks.length} blocks`,
  adapter_evict: (e) => `LoRA adapter ${e.seq_id} evicted: ${e.blocks.length} blocks back in the pool`,
};
const MAX_EVENTS = 400;
const LIVE_WINDOW_S = 120;
// Under --data-parallel-size the page shows one replica's pool: /dashboard?replica=i (replica 0 if not given).
const REPLICA = new URLSearchParams(location.search).get("replica");
const QUERY = REPLICA === null ? "" : `?replica=${encodeURIComponent(REPLICA)}`;

const S = (window.dashboardState = {
  mode: null, // "live" | "replay"
  connected: false,
  model: "",
  replica: null, // the replica shown, under --data-parallel-size (else null)
  replicas: [], // every replica's health and headline numbers (/dashboard/info), refreshed every 2 s
  framesReceived: 0,
  version: null,
  step: 0,
  time: 0,
  numBlocks: 0,
  blockSize: 0,
  kvPolicy: "",
  states: new Uint8Array(0),
  refs: new Int32Array(0),
  counts: { free: 0, used: 0, shared: 0, cached: 0, reserved: 0, restored: 0, adapter: 0 },
  peak: { free: 0, used: 0, shared: 0, cached: 0, reserved: 0, restored: 0, adapter: 0 }, // most blocks ever seen in each state
  requests: [],
  clients: [], // per client, the most served first: requests, tokens, queue time, weighted service
  counters: {},
  events: [], // newest last
  eventCounts: {},
  history: [], // [time, in use, cached, running, waiting, generated, hits, queries, preemptions]
  selected: null, // a request id: its blocks are highlighted
  grid: null, // the pool canvas's layout: {cell, cols, rows, gap} in CSS pixels
  holders: new Map(), // block id -> names of the samples whose tables hold it
  replay: { frames: [], index: 0, playing: false },
});

const $ = (id) => document.getElementById(id);
let dirty = false;

// ---- frames -> state ----------------------------------------------------------------------------------------------
function applyFrame(f) {
  if (f.error) return;
  if (f.full || S.numBlocks !== f.num_blocks) {
    S.numBlocks = f.num_blocks;
    S.states = new Uint8Array(f.num_blocks);
    S.refs = new Int32Array(f.num_blocks);
  }
  const b = f.blocks;
  for (let i = 0; i < b.length; i += 3) {
    S.states[b[i]] = b[i + 1];
    S.refs[b[i]] = b[i + 2];
  }
  S.version = f.version;
  S.step = f.step;
  S.time = f.time;
  S.blockSize = f.block_size;
  S.kvPolicy = f.kv_policy;
  if (f.model) S.model = f.model;
  S.requests = f.requests;
  S.clients = f.clients || [];
  S.counters = f.counters;
  S.framesReceived += 1;
  if (f.full && f.history) {
    S.history = f.history.slice();
    S.events = [];
  } else {
    S.history.push(historyPoint(f));
  }
  for (const e of f.events) S.events.push(e);
  if (S.events.length > MAX_EVENTS) S.events.splice(0, S.events.length - MAX_EVENTS);
  countEvents();
  recount();
  dirty = true;
}

function historyPoint(f) {
  const c = f.counters;
  return [f.time, c.blocks_in_use, c.blocks_cached_free, c.num_running, c.num_waiting, c.generated_tokens,
          c.prefix_cache_hits, c.prefix_cache_queries, c.preemptions];
}

function recount() {
  const counts = STATES.map(() => 0);
  for (let i = 0; i < S.states.length; i++) counts[S.states[i]]++;
  STATES.forEach((name, i) => {
    S.counts[name] = counts[i];
    S.peak[name] = Math.max(S.peak[name], counts[i]);
  });
  S.holders = new Map();
  for (const r of S.requests) {
    for (const s of r.samples) {
      const name = r.n > 1 ? `${r.request_id}#${s.index}` : r.request_id;
      for (const blk of s.block_table) {
        const list = S.holders.get(blk);
        if (list) list.push(name); else S.holders.set(blk, [name]);
      }
    }
  }
}

function countEvents() {
  // counted from the counters (the engine's totals), so a page opened late still shows them all
  const c = S.counters;
  S.eventCounts = { cow: c.cow_copies, fork: c.forks, preempt: c.preemptions, evict: c.evictions,
                    prefix_hit_tokens: c.prefix_cache_hits };
}

// ---- drawing ------------------------------------------------------------------------------------------------------
function fitCanvas(canvas, cssHeight) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  if (cssHeight !== undefined) canvas.style.height = cssHeight + "px";
  const h = cssHeight !== undefined ? cssHeight : canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return [ctx, w, h];
}

let grid = { cell: 10, cols: 1, gap: 1 };

function layoutGrid(width, n) {
  const target = Math.min(560, Math.max(160, n * 2)); // px of height we aim at
  let cell = Math.floor(Math.sqrt((width * target) / Math.max(1, n)));
  cell = Math.max(3, Math.min(26, cell));
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, gap: cell >= 6 ? 1 : 0, rows: Math.ceil(n / cols) };
}

function color(state, ref) {
  if (state === 2) return SHARED_SHADES[ref <= 2 ? 0 : ref <= 4 ? 1 : ref <= 8 ? 2 : 3];
  return COLORS[STATES[state]];
}

function selectedBlocks() {
  const set = new Set();
  if (S.selected === null) return set;
  for (const r of S.requests) {
    if (r.request_id !== S.selected) continue;
    for (const s of r.samples) for (const b of s.block_table) set.add(b);
  }
  return set;
}

function drawPool() {
  const canvas = $("pool");
  const n = S.numBlocks;
  grid = S.grid = layoutGrid(canvas.clientWidth, n);
  const [ctx, w] = fitCanvas(canvas, Math.max(grid.rows * grid.cell, 20));
  ctx.clearRect(0, 0, w, grid.rows * grid.cell);
  const sel = selectedBlocks();
  const dim = sel.size > 0;
  const { cell, cols, gap } = grid;
  const showRefs = cell >= 16;
  ctx.font = `${Math.max(8, cell - 8)}px system-ui, sans-serif`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (let i = 0; i < n; i++) {
    const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
    const st = S.states[i];
    ctx.globalAlpha = dim && !sel.has(i) ? 0.28 : 1;
    ctx.fillStyle = color(st, S.refs[i]);
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (showRefs && st === 2) {
      ctx.fillStyle = "#fff";
      ctx.fillText(String(S.refs[i]), x + (cell - gap) / 2, y + (cell - gap) / 2 + 0.5);
    }
  }
  ctx.globalAlpha = 1;
  if (dim) {
    ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--select");
    ctx.lineWidth = cell >= 8 ? 2 : 1;
    for (const i of sel) {
      const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
      ctx.strokeRect(x + 0.5, y + 0.5, cell - gap - 1, cell - gap - 1);
    }
  }
}

function drawLegend() {
  const pct = (k) => (S.numBlocks ? ((100 * S.counts[k]) / S.numBlocks).toFixed(1) : "0.0");
  const labels = { free: "free", used: "used by one", shared: "shared (ref > 1)", cached: "cached prefix, free",
                   reserved: "reserved, empty", restored: "held, restored from the KV tier",
                   adapter: "LoRA adapter weights" };
  $("legend").innerHTML = STATES.map((k) =>
    `<span class="key" data-state="${k}"><span class="sw" style="background:${COLORS[k]}"></span>${labels[k]}
     <b>${S.counts[k]}</b><span class="muted">${pct(k)}%</span></span>`).join("");
  $("pool-sub").textContent = `${S.numBlocks} blocks × ${S.blockSize} tokens · ${S.kvPolicy} · step ${S.step}`;
}

function fmt(x, digits = 0) {
  if (x === undefined || x === null || Number.isNaN(x)) return "–";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

// derived series: [t, kv usage %, cached %, running, waiting, tokens/s, hit rate %]
function series() {
  const h = S.history, out = [];
  const n = S.numBlocks || 1;
  let j = 0;
  for (let i = 0; i < h.length; i++) {
    while (j < i && h[i][0] - h[j][0] > 1.0) j++; // tokens/s over the last second or so
    const k = j < i ? j : Math.max(0, i - 1);
    const dt = h[i][0] - h[k][0];
    const rate = dt > 0 ? (h[i][5] - h[k][5]) / dt : (out.length ? out[out.length - 1][5] : 0);
    const hit = h[i][7] > 0 ? (100 * h[i][6]) / h[i][7] : 0;
    out.push([h[i][0], (100 * h[i][1]) / n, (100 * h[i][2]) / n, h[i][3], h[i][4], rate, hit]);
  }
  return out;
}

function drawCounters(ser) {
  const c = S.counters;
  const last = ser.length ? ser[ser.length - 1] : null;
  const cards = [
    ["KV cache usage", c.num_blocks ? `${fmt((100 * c.blocks_in_use) / c.num_blocks, 1)}%` : "–"],
    ["blocks in use", `${fmt(c.blocks_in_use)} / ${fmt(c.num_blocks)}`],
    ["cached-free blocks", fmt(c.blocks_cached_free)],
    ["running / waiting", `${fmt(c.num_running)} / ${fmt(c.num_waiting)}`],
    ["generated tokens/s", last ? fmt(last[5], 1) : "–"],
    ["prefix-cache hit rate", c.prefix_cache_queries ? `${fmt((100 * c.prefix_cache_hits) / c.prefix_cache_queries, 1)}%` : "–"],
    ["generated tokens", fmt(c.generated_tokens)],
    ["preemptions", fmt(c.preemptions)],
    ["copy-on-write copies", fmt(c.cow_copies)],
    ["forks", fmt(c.forks)],
    ["evictions", fmt(c.evictions)],
    ["prefix-cache hits", `${fmt(c.prefix_cache_hits)} tok`],
  ];
  $("counters").innerHTML = cards.map(([k, v]) => `<div class="card"><div class="v">${v}</div><div class="k">${k}</div></div>`).join("");
}

function drawChart(ser) {
  const canvas = $("chart");
  const [ctx, w, h] = fitCanvas(canvas);
  ctx.clearRect(0, 0, w, h);
  const panels = [
    { title: "KV cache usage %", lines: [[1, COLORS.used, "in use"], [2, COLORS.cached, "cached-free"]], max: 100 },
    { title: "requests", lines: [[3, "#2da44e", "running"], [4, "#8c959f", "waiting"]] },
    { title: "generated tokens/s", lines: [[5, "#8250df", "tokens/s"]] },
    { title: "prefix-cache hit rate %", lines: [[6, COLORS.cached, "hits / queries"]], max: 100 },
  ];
  const ph = h / panels.length;
  let t0, t1;
  if (S.mode === "replay") {
    const all = S.replay.series;
    t0 = all.length ? all[0][0] : 0;
    t1 = all.length ? all[all.length - 1][0] : 1;
  } else {
    t1 = ser.length ? Math.max(ser[ser.length - 1][0], Date.now() / 1000) : Date.now() / 1000;
    // the last LIVE_WINDOW_S seconds, or less if the page knows less (but at least 20 s)
    t0 = Math.min(t1 - 20, Math.max(t1 - LIVE_WINDOW_S, ser.length ? ser[0][0] : t1));
  }
  const data = S.mode === "replay" ? S.replay.series : ser;
  const left = 34, right = 8;
  const X = (t) => left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (w - left - right);
  panels.forEach((p, pi) => {
    const top = pi * ph + 16, bottom = (pi + 1) * ph - 6;
    let max = p.max || 1;
    if (!p.max) for (const row of data) for (const [col] of p.lines) if (row[0] >= t0) max = Math.max(max, row[col]);
    if (!p.max) max = niceMax(max);
    const Y = (v) => bottom - (v / max) * (bottom - top);
    ctx.strokeStyle = "#d8dee4";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(left, bottom + 0.5); ctx.lineTo(w - right, bottom + 0.5);
    ctx.moveTo(left, top + 0.5); ctx.lineTo(w - right, top + 0.5);
    ctx.stroke();
    ctx.fillStyle = "#656d76";
    ctx.font = "10px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText(fmt(max), left - 4, top);
    ctx.fillText("0", left - 4, bottom);
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    ctx.font = "600 11px system-ui, sans-serif";
    ctx.fillStyle = "#1f2328";
    ctx.fillText(p.title, left, top - 5);
    let x = left + ctx.measureText(p.title).width + 10;
    ctx.font = "11px system-ui, sans-serif";
    const cur = S.mode === "replay" ? ser[ser.length - 1] : data[data.length - 1];
    for (const [col, colr, label] of p.lines) {
      ctx.fillStyle = colr;
      const text = `${label} ${cur ? fmt(cur[col], col === 5 || col === 1 || col === 2 || col === 6 ? 1 : 0) : "–"}`;
      ctx.fillText(text, x, top - 5);
      x += ctx.measureText(text).width + 10;
      ctx.strokeStyle = colr;
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let started = false;
      for (const row of data) {
        if (row[0] < t0) continue;
        const px = X(row[0]), py = Y(Math.min(row[col], max));
        if (started) ctx.lineTo(px, py); else { ctx.moveTo(px, py); started = true; }
      }
      ctx.stroke();
    }
    if (S.mode === "replay" && ser.length) {
      ctx.strokeStyle = "#d62728";
      ctx.lineWidth = 1;
      ctx.beginPath();
      const cx = X(ser[ser.length - 1][0]);
      ctx.moveTo(cx, top); ctx.lineTo(cx, bottom);
      ctx.stroke();
    }
  });
  ctx.fillStyle = "#656d76";
  ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "right";
  ctx.fillText(`${S.mode === "replay" ? "" : "last "}${fmt(t1 - t0, 0)} s`, w - right, h - 1);
}

function niceMax(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function esc(s) {
  return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

function short(id) {
  // "cmpl-0123456789abcdef…#2" -> "cmpl-012345…#2": request ids are long, the samples' suffix matters
  const m = /^(.*?)(#\d+)?$/.exec(String(id));
  const base = m[1].length > 14 ? m[1].slice(0, 12) + "…" : m[1];
  return base + (m[2] || "");
}

function tableText(t) {
  const shown = t.slice(0, 40).join(" ");
  return t.length > 40 ? `${shown} … (+${t.length - 40})` : shown;
}

function drawRequests() {
  const rows = [];
  for (const r of S.requests) {
    const samples = r.samples.map((s) => {
      const frac = s.slots_held ? Math.min(1, s.tokens_stored / s.slots_held) : 0;
      const name = r.n > 1 ? `#${esc(s.index)} ` : "";
      const state = s.status === "finished" ? ` <span class="muted">finished</span>` : "";
      return `<div class="sample">${name}<span class="bar"><i style="width:${(100 * frac).toFixed(1)}%"></i></span>
        <span>${esc(s.tokens_stored)} / ${esc(s.slots_held)}</span><span class="muted">· ${esc(s.output_tokens)} out</span>${state}
        <span class="table-ids" title="${esc(s.block_table.join(" "))}">${s.block_table.length ? "[" + esc(tableText(s.block_table)) + "]" : ""}</span></div>`;
    }).join("");
    const sel = r.request_id === S.selected ? " selected" : "";
    rows.push(`<tr class="req${sel}" data-id="${esc(r.request_id)}"><td class="id" title="${esc(r.request_id)}">${esc(short(r.request_id))}</td>
      <td><span class="status st-${esc(r.status)}">${esc(r.status)}</span></td>
      <td class="who" title="client · priority">${esc(clientName(r.client))} · ${esc(r.priority ?? 0)}</td>
      <td class="prompt" title="${esc(r.prompt)}"><span class="muted">${esc(r.prompt_tokens)} tok${r.n > 1 ? ` · n=${esc(r.n)}` : ""} ·</span>
        ${esc(r.prompt) || '<span class="muted">–</span>'}</td>
      <td>${samples}</td></tr>`);
  }
  $("requests").innerHTML = rows.length ? rows.join("") : `<tr><td colspan="5" class="empty">no requests in the engine</td></tr>`;
  const c = S.counters;
  const listed = S.requests.length, total = (c.num_running || 0) + (c.num_waiting || 0);
  $("req-sub").textContent = `${fmt(c.num_running)} running · ${fmt(c.num_waiting)} waiting` +
    (listed < total ? ` (first ${listed} listed)` : "") + (S.selected ? " · click again to clear" : " · click one to highlight its blocks");
}

function clientName(c) {
  return c ? short(c) : "(anonymous)";
}

function drawClients() {
  const rows = S.clients.map((c) => `<tr><td title="${esc(c.client)}">${esc(clientName(c.client))}</td><td>${fmt(c.requests)}</td>
    <td>${fmt(c.prompt_tokens)}</td><td>${fmt(c.output_tokens)}</td>
    <td>${c.requests ? fmt(c.queue_time_s / c.requests, 2) + " s" : "–"}</td><td>${fmt(c.service)}</td></tr>`);
  $("clients").innerHTML = rows.length ? rows.join("") : `<tr><td colspan="6" class="empty">no client served yet</td></tr>`;
}

function drawEvents() {
  const c = S.eventCounts;
  $("event-counts").innerHTML = [["cow", "copy-on-write", c.cow], ["fork", "forks", c.fork], ["preempt", "preemptions", c.preempt],
    ["prefix_hit", "prefix-hit tokens", c.prefix_hit_tokens], ["evict", "evictions", c.evict]]
    .map(([k, label, v]) => `<span class="ev ev-${k}">${label} ${fmt(v)}</span>`).join("");
  const items = [];
  for (const [e, count, blocks] of coalesced(S.events, 200)) {
    const who = e.request_id ? ` · <span class="who" title="${esc(e.request_id)}">${esc(short(e.request_id))}</span>` : "";
    const text = count > 1 && e.kind === "evict"
      ? `evicted the cached prefixes of ${count} blocks: ${blocks.slice(0, 12).join(" ")}${count > 12 ? " …" : ""}`
      : (EVENT_TEXT[e.kind] || ((x) => x.kind))(e) + (count > 1 ? ` (×${count})` : "");
    items.push(`<li title="${esc(text)}"><span class="step">step ${esc(e.step)}</span><span class="ev ev-${esc(e.kind)}">${esc(e.kind)}</span> ${esc(text)}${who}</li>`);
  }
  $("events").innerHTML = items.join("") || `<li class="muted">no events yet</li>`;
}

// newest first; runs of one kind in one step (for one request) become one line: [event, count, blocks]
function coalesced(events, limit) {
  const out = [];
  for (let i = events.length - 1; i >= 0 && out.length <= limit; i--) {
    const e = events[i], last = out[out.length - 1];
    if (last && last[0].kind === e.kind && last[0].step === e.step && last[0].request_id === e.request_id &&
        (e.kind === "evict" || e.kind === "cow" || e.kind === "fork")) {
      last[1] += 1;
      last[2].push(...e.blocks.slice(0, 1));
    } else {
      out.push([e, 1, e.blocks.slice(0, 1)]);
    }
  }
  return out.slice(0, limit);
}

function drawMeta() {
  const when = S.time ? new Date(S.time * 1000).toLocaleTimeString() : "";
  $("meta").textContent = [S.model, S.replica !== null && `replica ${S.replica} of ${S.replicas.length}`, S.kvPolicy && `kv policy ${S.kvPolicy}`, when && `snapshot at ${when}`]
    .filter(Boolean).join(" · ");
  const conn = $("conn");
  if (S.mode === "replay") { conn.className = "pill replay"; conn.textContent = "replay"; }
  else if (S.connected) { conn.className = "pill live"; conn.textContent = "live"; }
  else { conn.className = "pill down"; conn.textContent = S.framesReceived ? "reconnecting…" : "connecting…"; }
}

function render() {
  if (dirty) {
    dirty = false;
    const ser = series();
    drawMeta();
    drawLegend();
    drawPool();
    drawCounters(ser);
    drawChart(ser);
    drawRequests();
    drawClients();
    drawEvents();
  }
}

// ---- interaction --------------------------------------------------------------------------------------------------
function blockAt(ev) {
  const rect = $("pool").getBoundingClientRect();
  const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
  const col = Math.floor(x / grid.cell), row = Math.floor(y / grid.cell);
  if (col < 0 || col >= grid.cols || row < 0) return -1;
  const i = row * grid.cols + col;
  return i < S.numBlocks ? i : -1;
}

function setupInteraction() {
  const pool = $("pool"), tip = $("tooltip");
  pool.addEventListener("mousemove", (ev) => {
    const i = blockAt(ev);
    if (i < 0) { tip.hidden = true; return; }
    const st = STATES[S.states[i]];
    const holders = S.holders.get(i) || [];
    const who = holders.length ? `<br>held by ${holders.slice(0, 6).map((h) => esc(short(h))).join(", ")}${holders.length > 6 ? ", …" : ""}` : "";
    tip.innerHTML = `block <b>${i}</b> · ${st} · ref count <b>${S.refs[i]}</b>${who}`;
    tip.hidden = false;
    const rect = pool.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    tip.style.left = Math.min(x + 14, rect.width - tip.offsetWidth - 4) + "px";
    tip.style.top = y + 16 + "px";
  });
  pool.addEventListener("mouseleave", () => { tip.hidden = true; });
  pool.addEventListener("click", (ev) => {
    const holders = S.holders.get(blockAt(ev)) || [];
    const id = holders.length ? holders[0].replace(/#\d+$/, "") : null;
    select(S.requests.some((r) => r.request_id === id) ? id : null);
  });
  $("requests").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr.req");
    if (tr) select(tr.dataset.id === S.selected ? null : tr.dataset.id);
  });
  window.addEventListener("resize", () => { dirty = true; });
}

function select(id) {
  S.selected = id;
  dirty = true;
}

// ---- sources ------------------------------------------------------------------------------------------------------
function connectLive() {
  const source = new EventSource(`/dashboard/events${QUERY}`);
  source.onopen = () => { S.connected = true; dirty = true; };
  source.onmessage = (msg) => { applyFrame(JSON.parse(msg.data)); S.connected = true; };
  source.onerror = () => { S.connected = false; dirty = true; }; // EventSource reconnects by itself
}

async function loadReplay() {
  const text = await (await fetch("/dashboard/trace")).text();
  const lines = text.split("\n").filter((l) => l.trim());
  const header = JSON.parse(lines[0]);
  const frames = lines.slice(1).map((l) => JSON.parse(l));
  S.model = header.model || "";
  S.replay.header = header;
  S.replay.frames = frames;
  S.replay.series = (() => { // the whole run's series, for the chart
    const saved = S.history, savedBlocks = S.numBlocks;
    S.history = frames.map(historyPoint);
    S.numBlocks = frames.length ? frames[0].num_blocks : 1;
    const all = series();
    S.history = saved; S.numBlocks = savedBlocks;
    return all;
  })();
  const slider = $("slider");
  slider.max = Math.max(0, frames.length - 1);
  slider.addEventListener("input", () => { stop(); seek(Number(slider.value)); });
  $("play").addEventListener("click", () => (S.replay.playing ? stop() : play()));
  $("replay").hidden = false;
  seek(0);
}

// ---- replicas (--data-parallel-size): one button per replica, with its headline numbers; a click shows its pool
function drawReplicas() {
  const nav = $("replicas");
  nav.hidden = !S.replicas.length;
  nav.replaceChildren(...S.replicas.map((r) => {
    const a = document.createElement("a");
    a.href = `?replica=${r.replica}`;
    a.className = "replica" + (r.replica === S.replica ? " current" : "") + (r.healthy ? "" : " down");
    a.dataset.replica = String(r.replica);
    const kv = r.num_blocks ? (100 * r.blocks_in_use) / r.num_blocks : null;
    const hit = r.prefix_cache_hit_rate === null || r.prefix_cache_hit_rate === undefined ? null : 100 * r.prefix_cache_hit_rate;
    const title = document.createElement("b");
    title.textContent = `replica ${r.replica}${r.healthy ? "" : " · down"}${r.restarts ? ` · ${r.restarts} restarts` : ""}`;
    const figures = document.createElement("span");
    figures.textContent = `KV ${fmt(kv, 1)}% · ${fmt(r.num_running)} running · ${fmt(r.num_waiting)} waiting · ` +
      `${fmt(r.tokens_per_s, 1)} tok/s · prefix hits ${fmt(hit, 1)}%`;
    a.append(title, figures);
    return a;
  }));
}

async function refreshReplicas() {
  try {
    const info = await (await fetch(`/dashboard/info${QUERY}`)).json();
    S.replicas = info.replicas || [];
    drawReplicas();
  } catch (e) { /* the server is restarting: the next refresh will tell */ }
}

function seek(index) {
  const frames = S.replay.frames;
  if (!frames.length) return;
  index = Math.max(0, Math.min(frames.length - 1, index));
  let k = index;
  while (k > 0 && !frames[k].full) k--;
  S.framesReceived = 0;
  for (let i = k; i <= index; i++) applyFrame({ ...frames[i], history: undefined, events: [] });
  S.history = frames.slice(0, index + 1).map(historyPoint);
  const events = [];
  for (let i = index; i >= 0 && events.length < MAX_EVENTS; i--) events.unshift(...frames[i].events.filter((e) => e.kind));
  const seen = new Set();
  S.events = events.filter((e) => !seen.has(e.index) && seen.add(e.index)).slice(-MAX_EVENTS);
  S.replay.index = index;
  $("slider").value = String(index);
  const t = frames[index].time - frames[0].time;
  $("frame-info").textContent = `frame ${index + 1} / ${frames.length} · step ${frames[index].step} · ${fmt(t, 2)} s`;
  dirty = true;
}

function play() {
  if (S.replay.index >= S.replay.frames.length - 1) seek(0);
  S.replay.playing = true;
  $("play").textContent = "❚❚ pause";
  S.replay.timer = setInterval(() => {
    if (S.replay.index >= S.replay.frames.length - 1) { stop(); return; }
    seek(S.replay.index + 1);
  }, 120);
}

function stop() {
  S.replay.playing = false;
  clearInterval(S.replay.timer);
  $("play").textContent = "▶ play";
}

async function main() {
  setupInteraction();
  const info = await (await fetch(`/dashboard/info${QUERY}`)).json();
  S.mode = info.mode;
  S.model = info.model || "";
  if (info.replicas) {
    S.replica = info.replica;
    S.replicas = info.replicas;
    drawReplicas();
    setInterval(refreshReplicas, 2000);
  }
  if (info.mode === "replay") await loadReplay(); else connectLive();
  const loop = () => { render(); requestAnimationFrame(loop); };
  requestAnimationFrame(loop);
  setInterval(() => {
    if (S.mode === "live" && S.framesReceived) dirty = true; // the chart's time axis moves on when the engine idles
    if (document.hidden) render(); // background tabs get no animation frames
  }, 1000);
}

main();
