// Shared by the playground (/) and the dashboard (/dashboard): the API key, calls to this server
// (and to no other host), server-sent events, and a small Markdown renderer. No framework, no CDN.
"use strict";

const KEY_SLOT = "radixserve.apiKey"; // sessionStorage: the key lives as long as the tab

function apiKey() {
  return sessionStorage.getItem(KEY_SLOT) || "";
}

function headers(extra) {
  const h = { "Content-Type": "application/json", ...(extra || {}) };
  const key = apiKey();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

class AuthNeeded extends Error {}

// fetch on this server; a 401 asks for the key (once) and retries
async function call(path, options) {
  for (let attempt = 0; attempt < 2; attempt++) {
    const r = await fetch(path, { ...(options || {}), headers: headers(options && options.headers) });
    if (r.status !== 401) return r;
    if (attempt === 0 && !(await askKey())) break;
  }
  throw new AuthNeeded("this server needs an API key");
}

async function getJSON(path) {
  const r = await call(path);
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status} ${await r.text()}`);
  return r.json();
}

// the key dialog, made on first use (the page's <body data-key-note> says why it needs the key)
function keyDialog() {
  let dialog = document.getElementById("key-dialog");
  if (dialog) return dialog;
  dialog = document.createElement("dialog");
  dialog.id = "key-dialog";
  dialog.setAttribute("aria-labelledby", "key-title");
  dialog.innerHTML = `<form method="dialog">
    <h2 id="key-title">API key</h2>
    <p id="key-note"></p>
    <label for="key-input">Key</label>
    <input id="key-input" type="password" autocomplete="off">
    <div class="actions"><button value="ok">Use it</button> <button value="cancel" formnovalidate>Cancel</button></div>
  </form>`;
  dialog.querySelector("#key-note").textContent =
    (document.body.dataset.keyNote || "This server needs an API key.") + " It is kept for this tab only.";
  document.body.append(dialog);
  return dialog;
}

function askKey() {
  const dialog = keyDialog();
  const input = document.getElementById("key-input");
  return new Promise((resolve) => {
    input.value = "";
    dialog.returnValue = "";
    dialog.onclose = () => {
      if (dialog.returnValue === "ok" && input.value.trim()) {
        sessionStorage.setItem(KEY_SLOT, input.value.trim());
        resolve(true);
      } else resolve(false);
    };
    dialog.showModal();
    input.focus();
  });
}

// POST `body` to `path` and hand each `data:` JSON of the event stream to onEvent; resolves at the end
async function stream(path, body, onEvent, signal) {
  const r = await call(path, { method: "POST", body: JSON.stringify(body), signal });
  if (!r.ok) {
    let message = `HTTP ${r.status}`;
    try {
      const j = await r.json();
      message = (j.error && j.error.message) || j.message || message;
    } catch (_) {}
    throw new Error(message);
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const chunk = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of chunk.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        let event;
        try {
          event = JSON.parse(data);
        } catch (_) {
          continue;
        }
        if (event.error) throw new Error(event.error.message || String(event.error));
        onEvent(event);
      }
    }
  }
}

// -- Markdown: the subset chat models write (fenced code, inline code, headings, lists, quotes,
// emphasis, links). Everything is escaped first: model output never becomes live HTML.
function escapeHTML(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function inline(s) {
  const codes = [];
  s = s.replace(/`([^`\n]+)`/g, (_, c) => {
    codes.push(c);
    return `\u0000${codes.length - 1}\u0000`;
  });
  s = escapeHTML(s)
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:[^)\s]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${escapeHTML(codes[Number(i)])}</code>`);
}

function markdown(text) {
  const out = [];
  const lines = text.split("\n");
  let i = 0;
  let list = null;
  const closeList = () => {
    if (list) out.push(`</${list}>`);
    list = null;
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)/);
    if (fence) {
      closeList();
      const body = [];
      i++;
      while (i < lines.length && !/^\s*```/.test(lines[i])) body.push(lines[i++]);
      i++;
      const lang = fence[1] ? ` data-lang="${escapeHTML(fence[1])}"` : "";
      out.push(`<pre${lang}><code>${escapeHTML(body.join("\n"))}</code></pre>`);
      continue;
    }
    let m;
    if ((m = line.match(/^(#{1,6})\s+(.*)/))) {
      closeList();
      const level = Math.min(m[1].length + 2, 6); // headings inside a message stay small
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
    } else if ((m = line.match(/^\s*[-*+]\s+(.*)/))) {
      if (list !== "ul") {
        closeList();
        out.push("<ul>");
        list = "ul";
      }
      out.push(`<li>${inline(m[1])}</li>`);
    } else if ((m = line.match(/^\s*\d+[.)]\s+(.*)/))) {
      if (list !== "ol") {
        closeList();
        out.push("<ol>");
        list = "ol";
      }
      out.push(`<li>${inline(m[1])}</li>`);
    } else if ((m = line.match(/^>\s?(.*)/))) {
      closeList();
      out.push(`<blockquote>${inline(m[1])}</blockquote>`);
    } else if (!line.trim()) {
      closeList();
    } else {
      closeList();
      out.push(`<p>${inline(line)}</p>`);
    }
    i++;
  }
  closeList();
  return out.join("");
}

function fmt(n, digits) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString(undefined, { maximumFractionDigits: digits === undefined ? 1 : digits });
}
