// The chat page of `uacompile serve`: conversations side by side, each streaming from /v1/chat/completions.
// Plain browser JavaScript, no build step; everything it loads comes from the server.
"use strict";

const state = { key: null, model: null, contextLen: null, nextId: 1, keyWaiters: [] };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

function banner(text) {
  const b = document.getElementById("banner");
  b.textContent = text || "";
  b.hidden = !text;
}

// One prompt for the key however many requests are waiting for it.
function askKey() {
  return new Promise((resolve) => {
    state.keyWaiters.push(resolve);
    const dlg = document.getElementById("key-dialog");
    if (!dlg.open) {
      document.getElementById("key-input").value = "";
      dlg.showModal();
    }
  });
}

document.getElementById("key-form").addEventListener("submit", () => {
  state.key = document.getElementById("key-input").value.trim() || null;
  const waiters = state.keyWaiters.splice(0);
  waiters.forEach((w) => w());
});

// fetch with the key; a 401 asks for the key and tries again.
async function api(path, init = {}) {
  for (;;) {
    const resp = await fetch(path, { ...init, headers: headers() });
    if (resp.status !== 401) return resp;
    await askKey();
  }
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${resp.status} ${resp.statusText}`;
}

async function loadModel() {
  try {
    const resp = await api("/v1/models");
    if (!resp.ok) { banner("cannot read /v1/models: " + await errorText(resp)); return; }
    const card = (await resp.json()).data[0];
    state.model = card.id;
    state.contextLen = card.max_model_len;
    document.getElementById("model").textContent = "model: " + card.id;
    document.getElementById("context").textContent = "context: " + card.max_model_len + " tokens";
    banner("");
  } catch (e) {
    banner("the server does not answer: " + e);
  }
}

function sampling() {
  const num = (id) => {
    const v = document.getElementById(id).value;
    return v === "" ? null : Number(v);
  };
  const body = { temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k"),
                 max_tokens: num("max_tokens"), seed: num("seed") };
  for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
  if (body.top_k !== undefined) body.top_k = Math.trunc(body.top_k);
  if (body.max_tokens !== undefined) body.max_tokens = Math.trunc(body.max_tokens);
  if (body.seed !== undefined) body.seed = Math.trunc(body.seed);
  return body;
}

function addMessage(conv, role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const span = document.createElement("span");
  span.className = "text";
  span.textContent = text;
  div.appendChild(span);
  conv.messagesEl.appendChild(div);
  conv.messagesEl.scrollTop = conv.messagesEl.scrollHeight;
  return div;
}

function setStats(div, text) {
  let s = div.querySelector(".stats");
  if (!s) { s = document.createElement("span"); s.className = "stats"; div.appendChild(s); }
  s.textContent = text;
}

// The data payloads of an SSE byte stream, as they arrive.
async function* sseData(reader) {
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) if (line.startsWith("data:")) yield line.slice(5).trim();
    }
  }
}

async function send(conv, text) {
  conv.history.push({ role: "user", content: text });
  addMessage(conv, "user", text);
  const out = addMessage(conv, "assistant", "");
  const textEl = out.querySelector(".text");
  const ctrl = new AbortController();
  conv.abort = ctrl;
  conv.setBusy(true);
  const t0 = performance.now();
  let tFirst = null, tLast = null, tokens = 0, usageTokens = null, answer = "";
  const stats = (extra) => {
    const parts = [];
    if (tFirst !== null) parts.push(`TTFT ${(tFirst - t0).toFixed(0)} ms`);
    const n = usageTokens ?? tokens;
    if (tFirst !== null && tLast > tFirst && n > 1) parts.push(`${((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tok/s`);
    parts.push(`${n} tokens`);
    if (extra) parts.push(extra);
    setStats(out, parts.join(" · "));
  };
  try {
    const body = { model: state.model || undefined, messages: conv.history, stream: true,
                   stream_options: { include_usage: true }, ...sampling() };
    const resp = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: ctrl.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const data of sseData(resp.body.getReader())) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usageTokens = chunk.usage.completion_tokens;
      for (const ch of chunk.choices || []) {
        const piece = (ch.delta && ch.delta.content) || "";
        if (piece) {
          const now = performance.now();
          if (tFirst === null) tFirst = now;
          tLast = now;
          tokens += 1;
          answer += piece;
          textEl.textContent = answer;
          conv.messagesEl.scrollTop = conv.messagesEl.scrollHeight;
        }
      }
      stats();
    }
    conv.history.push({ role: "assistant", content: answer });
    stats();
  } catch (e) {
    if (e.name === "AbortError") {
      conv.history.push({ role: "assistant", content: answer });
      stats("stopped");
    } else {
      conv.history.pop();  // the failed turn is not sent again
      if (!answer) out.remove();
      addMessage(conv, "error", String(e.message || e));
    }
  } finally {
    conv.abort = null;
    conv.setBusy(false);
  }
}

function newConversation() {
  const id = state.nextId++;
  const node = document.getElementById("conv-template").content.firstElementChild.cloneNode(true);
  node.dataset.conv = String(id);
  node.querySelector(".conv-title").textContent = "Conversation " + id;
  const conv = { id, history: [], abort: null, messagesEl: node.querySelector(".messages") };
  const prompt = node.querySelector(".prompt"), sendBtn = node.querySelector(".send"), stopBtn = node.querySelector(".stop");
  conv.setBusy = (busy) => { sendBtn.disabled = busy; stopBtn.disabled = !busy; node.classList.toggle("busy", busy); };
  node.querySelector(".composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = prompt.value.trim();
    if (!text || conv.abort) return;
    prompt.value = "";
    send(conv, text);
  });
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); node.querySelector(".composer").requestSubmit(); }
  });
  stopBtn.addEventListener("click", () => { if (conv.abort) conv.abort.abort(); });
  node.querySelector(".close").addEventListener("click", () => { if (conv.abort) conv.abort.abort(); node.remove(); });
  document.getElementById("convs").appendChild(node);
  return conv;
}

document.getElementById("new-conv").addEventListener("click", () => newConversation());
newConversation();
newConversation();
loadModel();
