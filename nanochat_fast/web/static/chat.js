"use strict";
// The conversation lives in this page: every request sends all of it, the server keeps nothing.
// Replies arrive as server-sent events over a streamed fetch (data: {"token": ...} ... {"done": true});
// Stop aborts that fetch, and the server stops generating when it sees the connection close.

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), scroll: $("scroll"), input: $("input"), composer: $("composer"),
  send: $("send"), stop: $("stop"), newChat: $("new-chat"), temperature: $("temperature"),
  topK: $("top-k"), error: $("error"), model: $("model"),
};

let conversation = [];  // {role: "user"|"assistant", content, state?: "streaming"|"done"|"stopped"}
let controller = null;  // the AbortController of the reply being generated, null when idle

async function loadServerInfo() {
  try {
    const info = await (await fetch("/health")).json();
    ui.model.textContent = info.model;
    ui.temperature.value = info.defaults.temperature;
    ui.topK.value = info.defaults.top_k;
  } catch (e) {
    showError(`cannot reach the server (${e.message})`);
  }
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
}

function button(label, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function renderMessage(msg, i) {
  const div = document.createElement("div");
  div.className = `message ${msg.role}`;
  const text = document.createElement("div");
  text.className = "text";
  text.textContent = msg.content;
  div.append(text);
  if (msg.role === "assistant") {
    div.dataset.state = msg.state;
    if (msg.state === "stopped") {
      const tag = document.createElement("span");
      tag.className = "tag";
      tag.textContent = "stopped";
      div.append(tag);
    }
  }
  // only the last turn can be changed: edit the last question, or ask for another answer
  const actions = document.createElement("div");
  actions.className = "actions";
  if (!controller && msg.role === "user" && i >= conversation.length - 2) {
    actions.append(button("Edit", "put this message back in the box, dropping it and its answer", () => editMessage(i)));
  }
  if (!controller && msg.role === "assistant" && i === conversation.length - 1) {
    actions.append(button("Regenerate", "replace this answer with a new one", regenerate));
  }
  if (actions.childElementCount) div.append(actions);
  return div;
}

function render() {
  ui.messages.replaceChildren(...conversation.map(renderMessage));
  ui.scroll.scrollTop = ui.scroll.scrollHeight;
  ui.send.hidden = controller !== null;
  ui.stop.hidden = controller === null;
  ui.send.disabled = !ui.input.value.trim();
}

function sampling() {
  const params = {};
  if (ui.temperature.value !== "") params.temperature = Number(ui.temperature.value);
  if (ui.topK.value !== "") params.top_k = Number(ui.topK.value);
  return params;
}

// Calls onEvent for each event before {"done": true}; throws if the stream ends without it.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the connection closed before the reply was complete");
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const event = JSON.parse(line.slice(6));
        if (event.done) return;
        onEvent(event);
      }
    }
  }
}

async function generate() {
  ui.error.hidden = true;
  const history = conversation.map(({ role, content }) => ({ role, content }));
  const reply = { role: "assistant", content: "", state: "streaming" };
  conversation.push(reply);
  const mine = (controller = new AbortController());
  render();
  const text = ui.messages.lastElementChild.querySelector(".text");
  try {
    const response = await fetch("/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages: history, ...sampling() }),
      signal: mine.signal,
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      const retry = response.headers.get("Retry-After");
      throw new Error((body.error || `HTTP ${response.status}`) + (retry ? ` (retry in ${retry} s)` : ""));
    }
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error);
      reply.content += event.token;
      text.textContent = reply.content;
      ui.scroll.scrollTop = ui.scroll.scrollHeight;
    });
    reply.state = "done";
  } catch (e) {
    reply.state = "stopped";
    if (e.name !== "AbortError") fail(reply, e.message);
  } finally {
    if (controller === mine) controller = null;
    render();
  }
}

// A reply that failed before saying anything is dropped, and its question goes back into the box
// (the conversation must keep alternating user/assistant); a partial one is kept as stopped.
function fail(reply, message) {
  showError(message);
  if (reply.content || conversation[conversation.length - 1] !== reply) return;
  conversation.pop();
  const question = conversation.pop();
  if (question && !ui.input.value) ui.input.value = question.content;
}

function send(event) {
  event.preventDefault();
  const text = ui.input.value;
  if (controller || !text.trim()) return;
  conversation.push({ role: "user", content: text });
  ui.input.value = "";
  autosize();
  generate();
}

function editMessage(i) {
  ui.input.value = conversation[i].content;
  conversation = conversation.slice(0, i);
  render();
  autosize();
  ui.input.focus();
}

function regenerate() {
  conversation.pop();
  generate();
}

function newChat() {
  if (controller) controller.abort();
  controller = null;
  conversation = [];
  ui.error.hidden = true;
  render();
  ui.input.focus();
}

function autosize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${ui.input.scrollHeight + 2}px`;
  ui.send.disabled = !ui.input.value.trim();
}

ui.composer.addEventListener("submit", send);
ui.stop.addEventListener("click", () => controller && controller.abort());
ui.newChat.addEventListener("click", newChat);
ui.input.addEventListener("input", autosize);
ui.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
});
render();
loadServerInfo();
ui.input.focus();
