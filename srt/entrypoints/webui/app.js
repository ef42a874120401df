// The playground: chat (streamed, with stop, regenerate, edit and resend), raw completion, and
// structured output, against this server's OpenAI-compatible routes. Conversations stay in this
// browser (localStorage); nothing is sent anywhere but to this server.
"use strict";

const STORE = "radixserve.conversations";
const $ = (id) => document.getElementById(id);
let props = null;
let conversations = [];
let current = null;
let running = null; // the AbortController of the answer being streamed

// -- conversations ---------------------------------------------------------------------------------

function load() {
  try {
    conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
  } catch (_) {
    conversations = [];
  }
  current = conversations[0] || newConversation(false);
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  renderConversations();
}

function newConversation(persist = true) {
  const c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New conversation", created: new Date().toISOString(), messages: [] };
  conversations.unshift(c);
  current = c;
  if (persist) {
    save();
    renderMessages();
  }
  return c;
}

function renderConversations() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    const open = document.createElement("button");
    open.textContent = c.title;
    open.className = "link";
    if (c === current) open.setAttribute("aria-current", "true");
    open.onclick = () => {
      current = c;
      renderConversations();
      renderMessages();
    };
    const del = document.createElement("button");
    del.textContent = "✕";
    del.className = "icon";
    del.setAttribute("aria-label", `Delete conversation ${c.title}`);
    del.onclick = () => {
      conversations = conversations.filter((x) => x !== c);
      if (current === c) current = conversations[0] || newConversation(false);
      save();
      renderMessages();
    };
    li.append(open, del);
    ul.append(li);
  }
}

function exportAll() {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `radixserve-conversations-${new Date().toISOString().slice(0, 19)}.json`;
  a.click();
  URL.revokeObjectURL(a.href);
}

// -- settings --------------------------------------------------------------------------------------

function seedSettings() {
  const d = (props && props.default_generation_settings && props.default_generation_settings.params) || {};
  $("temperature").value = d.temperature ?? 0.7;
  $("top_p").value = d.top_p ?? 1;
  $("top_k").value = d.top_k ?? -1;
  $("max_tokens").value = Math.min(d.n_predict > 0 ? d.n_predict : 512, 2048);
  $("tools-label").hidden = !(props && props.tool_call_parser);
}

function sampling() {
  const s = {
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    top_k: Number($("top_k").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") s.seed = Number($("seed").value);
  return s;
}

function tools() {
  const text = $("tools").value.trim();
  if ($("tools-label").hidden || !text) return undefined;
  const parsed = JSON.parse(text); // a bad list is reported as the answer's error
  if (!Array.isArray(parsed)) throw new Error("Tools must be a JSON list");
  return parsed;
}

// -- chat ------------------------------------------------------------------------------------------

function figuresText(f) {
  if (!f) return "";
  const parts = [];
  if (f.prompt_tokens !== undefined) parts.push(`${fmt(f.prompt_tokens, 0)} prompt tokens`);
  if (f.cached_tokens !== undefined) parts.push(`${fmt(f.cached_tokens, 0)} cached`);
  if (f.completion_tokens !== undefined) parts.push(`${fmt(f.completion_tokens, 0)} out`);
  if (f.tokens_per_s !== undefined) parts.push(`${fmt(f.tokens_per_s)} tok/s`);
  if (f.ttft_ms !== undefined) parts.push(`TTFT ${fmt(f.ttft_ms, 0)} ms`);
  if (f.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageBody(m) {
  const body = document.createElement("div");
  body.className = "body";
  if (m.reasoning) {
    const d = document.createElement("details");
    const s = document.createElement("summary");
    s.textContent = "Thinking";
    const p = document.createElement("div");
    p.innerHTML = markdown(m.reasoning);
    d.append(s, p);
    body.append(d);
  }
  const text = document.createElement("div");
  text.className = "text";
  if (m.role === "assistant") text.innerHTML = markdown(m.content || "");
  else text.textContent = m.content;
  body.append(text);
  for (const call of m.tool_calls || []) {
    const pre = document.createElement("pre");
    pre.className = "tool-call";
    pre.textContent = `${call.function.name}(${call.function.arguments})`;
    body.append(pre);
  }
  return body;
}

function renderMessages() {
  const ol = $("messages");
  ol.replaceChildren();
  current.messages.forEach((m, i) => {
    const li = document.createElement("li");
    li.className = `msg ${m.role}`;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = m.role === "user" ? "You" : "Model";
    li.append(who, messageBody(m));
    const bar = document.createElement("div");
    bar.className = "msg-actions";
    if (m.role === "assistant") {
      const f = document.createElement("span");
      f.className = "figures";
      f.textContent = figuresText(m.figures);
      bar.append(f);
      if (i === current.messages.length - 1 && !running) {
        const regen = document.createElement("button");
        regen.textContent = "Regenerate";
        regen.className = "small regenerate";
        regen.onclick = () => regenerate();
        bar.append(regen);
      }
    } else if (!running) {
      const edit = document.createElement("button");
      edit.textContent = "Edit";
      edit.className = "small edit";
      edit.onclick = () => editMessage(li, i);
      bar.append(edit);
    }
    li.append(bar);
    ol.append(li);
  });
  ol.lastElementChild && ol.lastElementChild.scrollIntoView({ block: "end" });
}

function editMessage(li, i) {
  const area = document.createElement("textarea");
  area.value = current.messages[i].content;
  area.rows = 3;
  area.setAttribute("aria-label", "Edit message");
  const send = document.createElement("button");
  send.textContent = "Save and resend";
  const cancel = document.createElement("button");
  cancel.textContent = "Cancel";
  send.onclick = () => {
    current.messages = current.messages.slice(0, i);
    current.messages.push({ role: "user", content: area.value });
    save();
    answer();
  };
  cancel.onclick = () => renderMessages();
  li.replaceChildren(area, send, cancel);
  area.focus();
}

function regenerate() {
  if (running) return;
  const last = current.messages[current.messages.length - 1];
  if (last && last.role === "assistant") current.messages.pop();
  answer();
}

function showError(e) {
  const p = $("error");
  p.textContent = e ? String(e.message || e) : "";
  p.hidden = !e;
}

function setRunning(controller) {
  running = controller;
  $("send").hidden = !!controller;
  $("stop").hidden = !controller;
}

async function answer() {
  showError(null);
  const history = current.messages.map((m) => {
    const out = { role: m.role, content: m.content || "" };
    if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
    return out;
  });
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], figures: {} };
  current.messages.push(msg);
  const controller = new AbortController();
  setRunning(controller);
  renderMessages(); // while running: no Regenerate or Edit buttons
  const live = $("messages").lastElementChild;
  const start = performance.now();
  let first = null;
  try {
    const body = { model: props ? props.model_alias : "default", messages, stream: true, stream_options: { include_usage: true }, ...sampling() };
    const t = tools();
    if (t) body.tools = t;
    await stream(
      "/v1/chat/completions",
      body,
      (ev) => {
        if (ev.usage) {
          msg.figures.prompt_tokens = ev.usage.prompt_tokens;
          msg.figures.completion_tokens = ev.usage.completion_tokens;
          msg.figures.cached_tokens = (ev.usage.prompt_tokens_details || {}).cached_tokens || 0;
        }
        const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
        if (!delta) return;
        if (first === null && (delta.content || delta.reasoning_content || delta.tool_calls)) first = performance.now();
        if (delta.content) msg.content += delta.content;
        if (delta.reasoning_content) msg.reasoning += delta.reasoning_content;
        for (const tc of delta.tool_calls || []) {
          const slot = (msg.tool_calls[tc.index] ||= { id: tc.id, type: "function", function: { name: "", arguments: "" } });
          if (tc.function && tc.function.name) slot.function.name += tc.function.name;
          if (tc.function && tc.function.arguments) slot.function.arguments += tc.function.arguments;
        }
        live.querySelector(".body").replaceWith(messageBody(msg));
      },
      controller.signal,
    );
  } catch (e) {
    if (e.name === "AbortError") msg.figures.stopped = true;
    else showError(e);
  } finally {
    const end = performance.now();
    if (first !== null) {
      msg.figures.ttft_ms = first - start;
      const n = msg.figures.completion_tokens;
      if (n && end > first) msg.figures.tokens_per_s = (n - 1) / ((end - first) / 1000) || undefined;
    }
    if (!msg.tool_calls.length) delete msg.tool_calls;
    if (!msg.reasoning) delete msg.reasoning;
    if (current.title === "New conversation" && current.messages.length) {
      current.title = current.messages[0].content.slice(0, 40) || "Conversation";
    }
    setRunning(null);
    save();
    renderMessages();
  }
}

function send(ev) {
  ev && ev.preventDefault();
  if (running) return;
  const text = $("prompt").value.trim();
  if (!text) return;
  current.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  save();
  answer();
}

// -- completion ------------------------------------------------------------------------------------

async function complete() {
  if (running) return;
  showError(null);
  const area = $("completion-text");
  const controller = new AbortController();
  running = controller;
  $("complete").hidden = true;
  $("complete-stop").hidden = false;
  const start = performance.now();
  let first = null;
  let usage = null;
  try {
    const s = sampling();
    const body = { model: props ? props.model_alias : "default", prompt: area.value, stream: true, stream_options: { include_usage: true }, ...s };
    await stream(
      "/v1/completions",
      body,
      (ev) => {
        if (ev.usage) usage = ev.usage;
        const t = ev.choices && ev.choices[0] && ev.choices[0].text;
        if (t) {
          if (first === null) first = performance.now();
          area.value += t;
        }
      },
      controller.signal,
    );
  } catch (e) {
    if (e.name !== "AbortError") showError(e);
  } finally {
    const f = {};
    if (usage) Object.assign(f, { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens, cached_tokens: (usage.prompt_tokens_details || {}).cached_tokens || 0 });
    if (first !== null) {
      f.ttft_ms = first - start;
      if (usage && usage.completion_tokens > 1) f.tokens_per_s = (usage.completion_tokens - 1) / ((performance.now() - first) / 1000);
    }
    $("completion-figures").textContent = figuresText(f);
    running = null;
    $("complete").hidden = false;
    $("complete-stop").hidden = true;
  }
}

// -- structured output -----------------------------------------------------------------------------

// the checks of JSON Schema that structured output uses most; returns the first violation or null
function validate(schema, v, path = "$") {
  if (schema === true || !schema || typeof schema !== "object") return null;
  const type = Array.isArray(v) ? "array" : v === null ? "null" : typeof v;
  const types = [].concat(schema.type || []);
  if (types.length) {
    const ok = types.some((t) => t === type || (t === "integer" && Number.isInteger(v)) || (t === "number" && type === "number"));
    if (!ok) return `${path} should be ${types.join(" or ")}`;
  }
  if (schema.enum && !schema.enum.some((e) => JSON.stringify(e) === JSON.stringify(v))) return `${path} is not one of the enum`;
  if ("const" in schema && JSON.stringify(schema.const) !== JSON.stringify(v)) return `${path} should be ${JSON.stringify(schema.const)}`;
  if (type === "number") {
    if (schema.minimum !== undefined && v < schema.minimum) return `${path} < minimum ${schema.minimum}`;
    if (schema.maximum !== undefined && v > schema.maximum) return `${path} > maximum ${schema.maximum}`;
  }
  if (type === "string") {
    if (schema.minLength !== undefined && v.length < schema.minLength) return `${path} is shorter than ${schema.minLength}`;
    if (schema.maxLength !== undefined && v.length > schema.maxLength) return `${path} is longer than ${schema.maxLength}`;
    if (schema.pattern && !new RegExp(schema.pattern).test(v)) return `${path} does not match ${schema.pattern}`;
  }
  if (type === "array") {
    if (schema.minItems !== undefined && v.length < schema.minItems) return `${path} has fewer than ${schema.minItems} items`;
    if (schema.maxItems !== undefined && v.length > schema.maxItems) return `${path} has more than ${schema.maxItems} items`;
    for (let i = 0; i < v.length; i++) {
      const e = validate(schema.items, v[i], `${path}[${i}]`);
      if (e) return e;
    }
  }
  if (type === "object") {
    for (const k of schema.required || []) if (!(k in v)) return `${path}.${k} is required`;
    const props = schema.properties || {};
    for (const [k, val] of Object.entries(v)) {
      if (k in props) {
        const e = validate(props[k], val, `${path}.${k}`);
        if (e) return e;
      } else if (schema.additionalProperties === false) return `${path}.${k} is not allowed`;
    }
  }
  for (const key of ["anyOf", "oneOf"]) {
    if (schema[key] && !schema[key].some((s) => validate(s, v, path) === null)) return `${path} matches none of ${key}`;
  }
  return null;
}

async function structured() {
  if (running) return;
  showError(null);
  const out = $("structured-out");
  const check = $("structured-check");
  out.textContent = "";
  check.textContent = "";
  let schema;
  try {
    schema = JSON.parse($("schema").value);
  } catch (e) {
    check.textContent = `The schema is not JSON: ${e.message}`;
    return;
  }
  const controller = new AbortController();
  running = controller;
  const start = performance.now();
  let first = null;
  let text = "";
  let usage = null;
  try {
    const body = {
      model: props ? props.model_alias : "default",
      messages: [{ role: "user", content: $("structured-prompt").value }],
      response_format: { type: "json_schema", json_schema: { name: "answer", schema, strict: true } },
      stream: true,
      stream_options: { include_usage: true },
      ...sampling(),
    };
    await stream(
      "/v1/chat/completions",
      body,
      (ev) => {
        if (ev.usage) usage = ev.usage;
        const d = ev.choices && ev.choices[0] && ev.choices[0].delta;
        if (d && d.content) {
          if (first === null) first = performance.now();
          text += d.content;
          out.textContent = text;
        }
      },
      controller.signal,
    );
    let value;
    try {
      value = JSON.parse(text);
      out.textContent = JSON.stringify(value, null, 2);
      const problem = validate(schema, value);
      check.textContent = problem ? `Does not validate: ${problem}` : "Valid: the answer matches the schema.";
      check.className = problem ? "error" : "ok";
    } catch (e) {
      check.textContent = `Not JSON (${e.message}); was the answer cut by max new tokens?`;
      check.className = "error";
    }
  } catch (e) {
    showError(e);
  } finally {
    const f = usage ? { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens } : {};
    if (first !== null) f.ttft_ms = first - start;
    $("structured-figures").textContent = figuresText(f);
    running = null;
  }
}

// -- tabs, keys, start -----------------------------------------------------------------------------

function selectTab(tab) {
  for (const t of document.querySelectorAll('[role="tab"]')) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  tab.focus();
}

function wire() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((t, i) => {
    t.onclick = () => selectTab(t);
    t.onkeydown = (e) => {
      if (e.key === "ArrowRight") selectTab(tabs[(i + 1) % tabs.length]);
      if (e.key === "ArrowLeft") selectTab(tabs[(i + tabs.length - 1) % tabs.length]);
    };
  });
  $("chat-form").onsubmit = send;
  $("prompt").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  };
  $("stop").onclick = () => running && running.abort();
  $("complete").onclick = complete;
  $("complete-stop").onclick = () => running && running.abort();
  $("structured-run").onclick = structured;
  $("new-chat").onclick = () => newConversation();
  $("export").onclick = exportAll;
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && running) running.abort();
  });
  const toggle = $("toggle-sidebar");
  toggle.onclick = () => {
    const open = document.body.classList.toggle("sidebar-open");
    toggle.setAttribute("aria-expanded", String(open));
  };
}

async function start() {
  wire();
  load();
  renderConversations();
  renderMessages();
  try {
    props = await getJSON("/props");
    const ctx = props.default_generation_settings && props.default_generation_settings.n_ctx;
    $("model").textContent = `${props.model_alias} · context ${fmt(ctx, 0)} · ${props.build_info}`;
  } catch (e) {
    $("model").textContent = "not connected";
    showError(e);
  }
  seedSettings();
}

start();
