// The dashboard: one GET /server_info a second (the schedulers' states, summed over data-parallel
// replicas), shown as figures, small charts of the last minutes, and per-feature and per-tenant tables.
"use strict";

const PERIOD_MS = 1000;
const KEEP = 300; // samples per chart: five minutes
const $ = (id) => document.getElementById(id);
const history = { running: [], queued: [], tokensIn: [], tokensOut: [], kvUse: [], hitRate: [] };
let last = null; // the previous sample, for rates
let paused = false;
let polls = 0;
let inflight = false; // a slow answer is never overlapped by the next poll

const CARDS = [
  ["running", "Running requests"],
  ["queued", "Queued requests"],
  ["tokensIn", "Prompt tokens/s"],
  ["tokensOut", "Output tokens/s"],
  ["kvUse", "KV pool used %"],
  ["cached", "Radix cache tokens"],
  ["hitRate", "Cache hit rate %"],
  ["passes", "Forward passes"],
  ["generated", "Output tokens (total)"],
];
const CHARTS = [
  ["running", "Running requests"],
  ["queued", "Queued requests"],
  ["tokensIn", "Prompt tokens/s"],
  ["tokensOut", "Output tokens/s"],
  ["kvUse", "KV pool used %"],
  ["hitRate", "Cache hit rate %"],
];

function sum(states, key) {
  return states.reduce((a, s) => a + (Number(s[key]) || 0), 0);
}

function sample(info) {
  const states = info.internal_states || [];
  const now = performance.now();
  const cap = sum(states, "kv_capacity");
  const free = sum(states, "kv_available");
  const cached = sum(states, "kv_evictable");
  const s = {
    t: now,
    running: sum(states, "num_running_reqs"),
    queued: sum(states, "num_queue_reqs"),
    kvUse: cap ? (100 * (cap - free - cached)) / cap : 0,
    cached,
    hitRate: states.length ? (100 * sum(states, "cache_hit_rate")) / states.length : 0,
    passes: sum(states, "forward_passes"),
    generated: sum(states, "generated_tokens_total"),
    prompt: sum(states, "prompt_tokens_total"),
  };
  const dt = last ? (now - last.t) / 1000 : 0;
  s.tokensIn = dt > 0 ? Math.max(0, s.prompt - last.prompt) / dt : 0;
  s.tokensOut = dt > 0 ? Math.max(0, s.generated - last.generated) / dt : 0;
  last = s;
  for (const k of Object.keys(history)) {
    history[k].push(s[k]);
    if (history[k].length > KEEP) history[k].shift();
  }
  return { s, states };
}

function renderCards(s) {
  const box = $("cards");
  if (!box.children.length) {
    for (const [key, label] of CARDS) {
      const card = document.createElement("div");
      card.className = "card";
      card.innerHTML = `<div class="label">${label}</div><div class="value" id="card-${key}" aria-live="off">–</div>`;
      box.append(card);
    }
  }
  for (const [key] of CARDS) $(`card-${key}`).textContent = fmt(s[key], key === "kvUse" || key === "hitRate" ? 1 : 0);
}

function drawChart(canvas, values) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth * dpr;
  const h = canvas.clientHeight * dpr;
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  if (values.length < 2) return;
  const top = Math.max(1, ...values);
  const color = getComputedStyle(document.documentElement).getPropertyValue("--accent").trim() || "#1a56db";
  ctx.strokeStyle = color;
  ctx.lineWidth = 2 * dpr;
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = w - ((values.length - 1 - i) / (KEEP - 1)) * w; // the newest sample at the right edge
    const y = h - (v / top) * (h - 4 * dpr) - 2 * dpr;
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function renderCharts() {
  const box = $("charts");
  if (!box.children.length) {
    for (const [key, label] of CHARTS) {
      const div = document.createElement("figure");
      div.className = "chart";
      div.innerHTML = `<figcaption class="label">${label}: <span id="chart-${key}-now">–</span> (max <span id="chart-${key}-max">–</span>)</figcaption><canvas id="chart-${key}" role="img" aria-label="${label} over the last minutes"></canvas>`;
      box.append(div);
    }
  }
  for (const [key] of CHARTS) {
    const v = history[key];
    $(`chart-${key}-now`).textContent = fmt(v[v.length - 1]);
    $(`chart-${key}-max`).textContent = fmt(Math.max(0, ...v));
    drawChart($(`chart-${key}`), v);
  }
}

function row(name, value) {
  const tr = document.createElement("tr");
  const th = document.createElement("th");
  th.scope = "row";
  th.textContent = name;
  const td = document.createElement("td");
  td.textContent = value;
  tr.append(th, td);
  return tr;
}

function renderFeatures(info, states) {
  const rows = [];
  states.forEach((st, i) => {
    const p = states.length > 1 ? `replica ${i}: ` : "";
    rows.push(row(`${p}batch`, `${st.num_running_reqs} running, ${st.num_queue_reqs} queued, ${st.req_slots_free} request slots free`));
    rows.push(row(`${p}KV pool`, `${fmt(st.kv_capacity - st.kv_available - st.kv_evictable, 0)} used, ${fmt(st.kv_evictable, 0)} cached, ${fmt(st.kv_available, 0)} free of ${fmt(st.kv_capacity, 0)} tokens`));
    if (st.hicache) {
      const tiers = Object.entries(st.hicache)
        .filter(([, v]) => typeof v !== "object")
        .slice(0, 8)
        .map(([k, v]) => `${k} ${fmt(v, 2)}`)
        .join(", ");
      rows.push(row(`${p}hierarchical cache`, tiers));
    }
    if (st.speculative) rows.push(row(`${p}speculative decoding`, `accept length ${fmt(st.avg_spec_accept_length, 2)}, accept rate ${fmt(100 * st.spec_accept_rate)}%`));
    if (st.lora) {
      const names = (st.lora.adapters || []).map((a) => a.lora_name + (a.slot === null || a.slot === undefined || a.slot < 0 ? " (not in a slot)" : ""));
      const running = (st.lora.running_adapters || []).join(", ") || "none";
      rows.push(row(`${p}LoRA adapters`, `${names.join(", ") || "none"}; in the running batch: ${running}`));
    }
    if (st.weights) rows.push(row(`${p}weights`, `version ${st.weights.weight_version}${st.weights.paused ? ", generation paused (" + st.weights.paused + ")" : ""}`));
    rows.push(row(`${p}forward`, `${fmt(100 * st.forward_idle_fraction)}% idle between passes, ${st.attention_backend} attention${st.overlap_schedule ? ", overlap schedule" : ""}`));
  });
  $("features").replaceChildren(...rows);
  const tenants = Object.entries(info.tenants || {});
  $("tenants").replaceChildren(
    ...(tenants.length
      ? tenants.map(([name, t]) => {
          const tr = document.createElement("tr");
          for (const v of [name, fmt(t.requests, 0), fmt(t.prompt_tokens, 0)]) {
            const td = document.createElement("td");
            td.textContent = v;
            tr.append(td);
          }
          return tr;
        })
      : [row("none", "no request in flight")]),
  );
}

async function poll() {
  if (paused || inflight) return;
  inflight = true;
  try {
    const info = await getJSON("/server_info");
    polls++;
    const { s, states } = sample(info);
    if (polls === 1) $("model").textContent = `${info.served_model_name || info.model_path} · ${states.length} replica(s) · ${info.version}`;
    renderCards(s);
    renderCharts();
    renderFeatures(info, states);
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()} (${polls} polls, one /server_info call each)`;
    $("error").hidden = true;
  } catch (e) {
    $("error").textContent = String(e.message || e);
    $("error").hidden = false;
  } finally {
    inflight = false;
  }
}

$("pause").onclick = () => {
  paused = !paused;
  $("pause").setAttribute("aria-pressed", String(paused));
  $("pause").textContent = paused ? "Resume updates" : "Pause updates";
};
poll();
setInterval(poll, PERIOD_MS);
