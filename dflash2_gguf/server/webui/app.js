// dflash2-gguf web page: a streaming chat with the served model that marks every token that came
// from an accepted draft. Vanilla JS, no dependencies. The server side is dflash2_gguf/server/web.py;
// the stream's `draft_marks` field (asked for with `return_draft_marks`) is documented there.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "dflash2-gguf.apiKey";
const SETTINGS_STORE = "dflash2-gguf.settings";
const FIELDS = ["system", "temperature", "max_tokens", "top_k", "top_p", "min_p", "seed"];

const state = { messages: [], controller: null, pendingRetry: null };

// ------------------------------------------------------------------ API key and requests

function apiHeaders() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY_STORE);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

class Unauthorized extends Error {}

async function api(path, init = {}) {
  const r = await fetch(path, { ...init, headers: { ...apiHeaders(), ...(init.headers || {}) } });
  if (r.status === 401) {
    askForKey();
    throw new Unauthorized("this server needs an API key");
  }
  if (!r.ok) {
    let msg = r.status + " " + r.statusText;
    try { const j = await r.json(); msg = (j.error && j.error.message) || msg; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  return r;
}

function askForKey() {
  $("keybox").hidden = false;
  $("apikey").focus();
}

$("savekey").addEventListener("click", () => {
  const k = $("apikey").value.trim();
  if (k) localStorage.setItem(KEY_STORE, k); else localStorage.removeItem(KEY_STORE);
  $("keybox").hidden = true;
  showError("");
  loadModel();
  const retry = state.pendingRetry;
  state.pendingRetry = null;
  if (retry) retry();
});

async function loadModel() {
  try {
    const j = await (await api("v1/models")).json();
    const m = (j.data && j.data[0]) || {};
    const meta = m.meta || {};
    $("model").textContent = (m.id || "") + (meta.drafter ? "  ·  drafter " + meta.drafter.split("/").pop() : "  ·  no drafter");
  } catch (e) {
    if (!(e instanceof Unauthorized)) $("model").textContent = "(model unavailable: " + e.message + ")";
  }
}

// ------------------------------------------------------------------ settings

function loadSettings() {
  try {
    const s = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
    for (const f of FIELDS) if (s[f] !== undefined) $(f).value = s[f];
  } catch (e) { /* ignore a damaged entry */ }
}

function saveSettings() {
  const s = {};
  for (const f of FIELDS) s[f] = $(f).value;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(s));
}

function num(id, parse) {
  const v = $(id).value.trim();
  if (v === "") return undefined;
  const x = parse(v);
  return Number.isFinite(x) ? x : undefined;
}

function requestBody() {
  const msgs = [];
  const sys = $("system").value.trim();
  if (sys) msgs.push({ role: "system", content: sys });
  for (const m of state.messages) msgs.push({ role: m.role, content: m.content });
  const body = {
    messages: msgs, stream: true, return_draft_marks: true, timings_per_token: true,
    temperature: num("temperature", parseFloat), max_tokens: num("max_tokens", (v) => parseInt(v, 10)),
    top_k: num("top_k", (v) => parseInt(v, 10)), top_p: num("top_p", parseFloat),
    min_p: num("min_p", parseFloat), seed: num("seed", (v) => parseInt(v, 10)),
  };
  for (const k of Object.keys(body)) if (body[k] === undefined) delete body[k];
  return body;
}

// ------------------------------------------------------------------ rendering

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (text) div.textContent = text;
  $("messages").appendChild(div);
  scrollDown();
  return div;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function fmt(x, digits) {
  return x === undefined || x === null || !Number.isFinite(x) ? "–" : x.toFixed(digits);
}

// Live statistics of one reply, from its draft marks and timings.
class ReplyStats {
  constructor() {
    this.tokens = 0; this.cycles = 0; this.committed = 0; this.drafted = 0; this.accepted = 0;
    this.lastDraftN = null; this.cached = null; this.tps = null; this.final = null;
  }
  addMarks(m) {
    const first = this.tokens === 0;
    this.tokens += m.pieces.length;
    this.cached = m.cache_n;
    if (first) return; // the prefill's token: no verification cycle
    this.cycles += 1;
    this.committed += m.pieces.length;
    this.drafted += m.draft_n;
    this.accepted += m.from_draft.filter(Boolean).length;
    this.lastDraftN = m.draft_n;
  }
  addTimings(t) {
    if (t.predicted_per_second) this.tps = t.predicted_per_second;
    if (t.acceptance_length !== undefined) {
      this.final = t;
      this.cached = t.cache_n;
      if (t.predicted_per_second) this.tps = t.predicted_per_second;
    }
  }
  acceptanceLength() {
    if (this.final && this.final.n_cycles) return this.final.acceptance_length;
    return this.cycles ? this.committed / this.cycles : null;
  }
  meanDraftN() {
    if (this.final && this.final.n_cycles) return this.final.draft_n / this.final.n_cycles;
    return this.cycles ? this.drafted / this.cycles : null;
  }
  show() {
    $("stat-tps").textContent = fmt(this.tps, 1);
    $("stat-al").textContent = fmt(this.acceptanceLength(), 2);
    const mean = this.meanDraftN();
    $("stat-dn").textContent = this.lastDraftN === null ? "–" : this.lastDraftN + " (mean " + fmt(mean, 1) + ")";
    const acc = this.final ? this.final.draft_n_accepted : this.accepted;
    const dr = this.final ? this.final.draft_n : this.drafted;
    $("stat-drafted").textContent = acc + " / " + dr + " accepted";
    $("stat-cached").textContent = this.cached === null ? "–" : String(this.cached);
  }
  summary(finish) {
    const parts = [this.tokens + " tokens", fmt(this.tps, 1) + " tokens/s",
      "acceptance length " + fmt(this.acceptanceLength(), 2), "mean draft length " + fmt(this.meanDraftN(), 1),
      "cached prompt tokens " + (this.cached === null ? "–" : this.cached)];
    if (finish) parts.push(finish === "length" ? "stopped at max tokens" : finish);
    return parts.join(" · ");
  }
}

// ------------------------------------------------------------------ streaming

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function showError(msg) {
  $("error").textContent = msg || "";
  $("error").hidden = !msg;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  saveSettings();
  showError("");
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  await run();
}

async function run() {
  const div = addMessage("assistant", "");
  const reasoningEl = document.createElement("span");
  reasoningEl.className = "reasoning";
  const body = document.createElement("span");
  body.className = "body";
  const meta = document.createElement("span");
  meta.className = "meta";
  div.append(body, meta);
  const stats = new ReplyStats();
  let content = "", reasoning = "", marked = false, finish = null;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  try {
    const r = await api("v1/chat/completions", {
      method: "POST", body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message || "generation failed");
        const ch = (ev.choices && ev.choices[0]) || {};
        const d = ch.delta || {};
        // a reasoning model's thoughts go above the answer, dimmed
        const thinking = Boolean(d.reasoning_content) && !d.content;
        if (d.reasoning_content) {
          reasoning += d.reasoning_content;
          if (!reasoningEl.parentNode) div.insertBefore(reasoningEl, body);
        }
        if (d.content) content += d.content;
        if (ev.draft_marks) {
          marked = true;
          const m = ev.draft_marks;
          const frag = document.createDocumentFragment();
          m.pieces.forEach((p, i) => {
            const s = document.createElement("span");
            s.className = m.from_draft[i] ? "tok draft" : "tok";
            s.textContent = p;
            frag.appendChild(s);
          });
          (thinking ? reasoningEl : body).appendChild(frag);
          stats.addMarks(m);
        } else if (!marked) { // a server without draft marks: the deltas as they come
          if (d.reasoning_content) reasoningEl.appendChild(document.createTextNode(d.reasoning_content));
          if (d.content) body.appendChild(document.createTextNode(d.content));
        }
        if (ev.timings) stats.addTimings(ev.timings);
        if (ch.finish_reason) finish = ch.finish_reason;
        stats.show();
        scrollDown();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else if (e instanceof Unauthorized) {
      state.pendingRetry = () => { div.remove(); run(); };
      div.remove();
      showError("This server needs an API key: enter it on the left.");
      finishRun();
      return;
    } else showError(e.message);
  }
  // the tokens' texts are the raw output: where the answer differs (a template's thinking tags, a
  // stop string), show the answer as the server parsed it, unmarked
  if (content && body.textContent.trim() !== content.trim()) body.textContent = content;
  state.messages.push({ role: "assistant", content: content || body.textContent });
  meta.textContent = stats.summary(finish);
  stats.show();
  finishRun();
}

function finishRun() {
  state.controller = null;
  setBusy(false);
  $("prompt").focus();
}

// ------------------------------------------------------------------ wiring

$("form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").textContent = "";
  showError("");
});
for (const f of FIELDS) $(f).addEventListener("change", saveSettings);

loadSettings();
loadModel();
