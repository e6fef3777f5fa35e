// localllm's chat page: vanilla JavaScript, no framework, nothing fetched from anywhere but this server.
// Conversations, settings and the theme live in this browser's localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const store = {
  get(key, fallback) {
    try { const v = localStorage.getItem("localllm." + key); return v === null ? fallback : JSON.parse(v); }
    catch (e) { return fallback; }
  },
  set(key, value) { try { localStorage.setItem("localllm." + key, JSON.stringify(value)); } catch (e) { /* full */ } },
};

// ---- Markdown (a small subset, rendered from escaped text) ----------------------------------------------

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

const KEYWORDS = new Set(("and as assert async await break case catch class const continue def default del do elif " +
  "else enum except export extends false finally fn for from func function go if impl import in interface is " +
  "lambda let loop match mod mut new nil none None not null or package pass pub raise return self Self static " +
  "struct super switch this throw true True False try type typeof use var void while with yield int float str " +
  "bool char long double unsigned signed include define printf print echo fi then done esac local").split(" "));
const TOKEN = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`|\b\d+(?:\.\d+)?\b|\b[A-Za-z_][A-Za-z0-9_]*\b)/g;

function highlight(code, lang) {
  const hashComments = !/^(c|cpp|c\+\+|js|javascript|ts|typescript|java|rust|go|css|json)$/i.test(lang || "");
  let out = "", last = 0, m;
  TOKEN.lastIndex = 0;
  while ((m = TOKEN.exec(code)) !== null) {
    const t = m[0];
    out += escapeHtml(code.slice(last, m.index));
    last = m.index + t.length;
    let cls = null;
    if (t.startsWith("//") || t.startsWith("/*")) cls = "com";
    else if (t.startsWith("#")) {
      if (hashComments) cls = "com";
      else { out += escapeHtml(t[0]); last = m.index + 1; TOKEN.lastIndex = last; continue; }
    }
    else if (/^["'`]/.test(t)) cls = "str";
    else if (/^\d/.test(t)) cls = "num";
    else if (KEYWORDS.has(t)) cls = "kw";
    out += cls ? `<span class="tok-${cls}">${escapeHtml(t)}</span>` : escapeHtml(t);
  }
  return out + escapeHtml(code.slice(last));
}

function inline(text) {
  const codes = [];
  let s = text.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
  s = escapeHtml(s);
  s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>").replace(/(^|\W)_([^_\n]+)_(?=\W|$)/g, "$1<em>$2</em>");
  s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g,
    (_, t, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${t}</a>`);
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${escapeHtml(codes[+i])}</code>`);
}

function markdown(src) {
  const lines = src.replace(/\r\n/g, "\n").split("\n");
  const html = [];
  let para = [], list = null;
  const flushPara = () => { if (para.length) html.push(`<p>${para.map(inline).join("<br>")}</p>`); para = []; };
  const flushList = () => { if (list) html.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`); list = null; };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    if (fence) {
      flushPara(); flushList();
      const body = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
      const lang = fence[1] || "";
      html.push(`<pre>${lang ? `<span class="lang">${escapeHtml(lang)}</span>` : ""}<code>${highlight(body.join("\n"), lang)}</code></pre>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flushPara(); flushList();
      const level = Math.min(heading[1].length + 2, 6);  // an answer's "#" is not the page's title
      html.push(`<h${level}>${inline(heading[2])}</h${level}>`);
    }
    else if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
      list.items.push((bullet || numbered)[1]);
    }
    else if (/^\s*>\s?/.test(line)) { flushPara(); flushList(); html.push(`<blockquote>${inline(line.replace(/^\s*>\s?/, ""))}</blockquote>`); }
    else if (!line.trim()) { flushPara(); flushList(); }
    else { flushList(); para.push(line); }
  }
  flushPara(); flushList();
  return html.join("");
}

// ---- loop guard (localllm/loop_guard.py's rule, lines only: a line of prose the 4th time ends the answer) ----

function repeatedLine(text) {
  const counts = new Map();
  let code = false;
  const lines = text.split("\n");
  lines.pop();  // the line still being written
  for (const raw of lines) {
    if (/^\s*```/.test(raw)) { code = !code; continue; }
    const key = raw.replace(/^\s*(?:[-*+>#]+|\d+[.)])\s+/, "").replace(/\s+/g, " ").trim().toLowerCase();
    if (key.split(" ").length < (code ? 1 : 3) || (key.match(/[\p{L}\p{N}]/gu) || []).length < 8) continue;
    const n = (counts.get(key) || 0) + 1;
    counts.set(key, n);
    if (n >= (code ? 8 : 4)) return true;
  }
  return false;
}

// ---- state -------------------------------------------------------------------------------------------

const SETTINGS = ["system", "temperature", "top_p", "top_k", "min_p", "dry_multiplier", "max_tokens", "seed", "api_key"];
let chats = store.get("chats", []);
let current = store.get("current", null);
let controller = null;

function chat() { return chats.find((c) => c.id === current) || null; }
function save() { store.set("chats", chats); store.set("current", current); }
function newChat() {
  const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  chats.unshift(c); current = c.id; save(); render();
}

function setStatus(text, error) { const s = $("status"); s.textContent = text; s.className = error ? "error" : ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// ---- rendering -----------------------------------------------------------------------------------------

function messageNode(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  if (m.role === "user") div.textContent = m.content;
  else div.innerHTML = markdown(m.content) + (m.note ? `<div class="note">${escapeHtml(m.note)}</div>` : "");
  return div;
}

function render() {
  const list = $("chats");
  list.textContent = "";
  for (const c of chats) {
    const li = document.createElement("li");
    li.className = c.id === current ? "current" : "";
    const span = document.createElement("span");
    span.textContent = c.title;
    const del = document.createElement("button");
    del.type = "button"; del.textContent = "\u00d7"; del.title = "Delete this chat";
    del.onclick = (e) => { e.stopPropagation(); chats = chats.filter((x) => x.id !== c.id); if (current === c.id) current = chats.length ? chats[0].id : null; save(); render(); };
    li.onclick = () => { if (!controller) { current = c.id; save(); render(); } };
    li.append(span, del);
    list.append(li);
  }
  const box = $("messages");
  box.textContent = "";
  const c = chat();
  for (const m of c ? c.messages : []) box.append(messageNode(m));
  box.scrollTop = box.scrollHeight;
  const last = c && c.messages[c.messages.length - 1];
  $("regenerate").hidden = !!controller || !last || last.role !== "assistant";
}

// ---- talking to the server -----------------------------------------------------------------------------

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) { setStatus("This server wants an API key: enter it in Settings.", true); return; }
    const body = await r.json();
    const sel = $("model");
    const saved = store.get("model", null);
    sel.textContent = "";
    for (const m of body.data || []) {
      const o = document.createElement("option");
      o.value = o.textContent = m.id;
      sel.append(o);
    }
    if (saved && [...sel.options].some((o) => o.value === saved)) sel.value = saved;
    setStatus(sel.options.length ? "" : "No model is served.", !sel.options.length);
  } catch (e) { setStatus("Cannot reach the server: " + e.message, true); }
}

function requestBody(messages) {
  const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };
  const body = { model: $("model").value || undefined, stream: true, messages: [] };
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of messages) body.messages.push({ role: m.role, content: m.content });
  for (const k of ["temperature", "top_p", "top_k", "min_p", "dry_multiplier", "max_tokens", "seed"]) {
    const v = num(k);
    if (v !== undefined && !Number.isNaN(v)) body[k] = v;
  }
  return body;
}

async function answer() {
  const c = chat();
  const reply = { role: "assistant", content: "" };
  const history = c.messages.slice();
  c.messages.push(reply);
  render();
  const node = $("messages").lastElementChild;
  node.classList.add("streaming");
  controller = new AbortController();
  $("send").hidden = true; $("stop").hidden = false; $("regenerate").hidden = true;
  setStatus("Thinking\u2026");
  let pending = false, tokens = 0, looped = false;
  const t0 = performance.now();
  let tFirst = null;
  const paint = () => {
    pending = false;
    node.innerHTML = markdown(reply.content);
    const box = $("messages"); box.scrollTop = box.scrollHeight;
  };
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(requestBody(history)), signal: controller.signal });
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { const e = await r.json(); msg = (e.error && (e.error.message || e.error)) || msg; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message || String(ev.error));
        const choice = ev.choices && ev.choices[0];
        if (!choice) continue;
        const text = choice.delta && choice.delta.content;
        if (text) {
          if (tFirst === null) tFirst = performance.now();
          tokens++;
          reply.content += text;
          if (!pending) { pending = true; requestAnimationFrame(paint); }
          if (text.includes("\n") && repeatedLine(reply.content)) {
            reply.note = "Stopped: the answer kept repeating the same line (loop guard). Regenerate, or raise the DRY multiplier in Settings.";
            looped = true;
            controller.abort();
          }
        }
        if (choice.finish_reason === "length") reply.note = "Reached max tokens: raise it in Settings, or regenerate.";
      }
    }
    const secs = (performance.now() - (tFirst || t0)) / 1000;
    setStatus(tFirst ? `first token ${((tFirst - t0) / 1000).toFixed(2)} s \u00b7 ${(tokens / Math.max(secs, 1e-3)).toFixed(1)} chunks/s` : "");
  } catch (e) {
    if (e.name === "AbortError") { if (!looped) reply.note = "Stopped."; setStatus(looped ? "Loop guard" : "Stopped."); }
    else { reply.note = "Error: " + e.message; setStatus(e.message, true); }
  } finally {
    controller = null;
    if (c.title === "New chat" && history.length) c.title = history[0].content.slice(0, 40);
    save();
    $("send").hidden = false; $("stop").hidden = true;
    render();
  }
}

function send(text) {
  if (!text.trim() || controller) return;
  if (!chat()) newChat();
  chat().messages.push({ role: "user", content: text });
  save();
  answer();
}

// ---- wiring ------------------------------------------------------------------------------------------

function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  $("theme").textContent = "Theme: " + theme;
}

document.addEventListener("DOMContentLoaded", () => {
  const saved = store.get("settings", {});
  for (const k of SETTINGS) if (saved[k] !== undefined) $(k).value = saved[k];
  for (const k of SETTINGS) $(k).addEventListener("change", () => {
    const s = {}; for (const j of SETTINGS) s[j] = $(j).value; store.set("settings", s);
    if (k === "api_key") loadModels();
  });
  let theme = store.get("theme", "auto");
  applyTheme(theme);
  $("theme").onclick = () => { theme = { auto: "light", light: "dark", dark: "auto" }[theme]; store.set("theme", theme); applyTheme(theme); };
  $("settings-toggle").onclick = () => {
    const s = $("settings"); s.hidden = !s.hidden; $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
  };
  $("model").onchange = () => store.set("model", $("model").value);
  $("new-chat").onclick = () => { if (!controller) newChat(); };
  $("composer").onsubmit = (e) => { e.preventDefault(); const t = $("input").value; $("input").value = ""; send(t); };
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").onclick = () => { if (controller) controller.abort(); };
  $("regenerate").onclick = () => {
    const c = chat();
    if (!c || controller) return;
    if (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
    save(); answer();
  };
  if (!chat() && chats.length) current = chats[0].id;
  render();
  loadModels();
});
