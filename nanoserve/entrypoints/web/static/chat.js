// The chat page: conversations kept in localStorage, settings that start from the model's own
// sampling defaults (GET /web/defaults), answers streamed from /v1/chat/completions. A server
// holding several models (--models-dir) lists them in GET /v1/models: the page shows a picker,
// and the chosen model's own server answers its defaults (/web/defaults?model=NAME). Images
// attached to a message (attachments.js) stay in its turn and go with the history.

import { checkImages, hasAttached, imageStrip, takeAttached, userContent, wireAttachments }
  from "./attachments.js";
import { apiFetch, el, errorText } from "./common.js";
import { copyText, renderMarkdown } from "./markdown.js";
import { streamAnswer } from "./stream.js";

const $ = (id) => document.getElementById(id);
const STORE = { conversations: "nanoserve.conversations", current: "nanoserve.current",
  settings: "nanoserve.settings", model: "nanoserve.model" };
const FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens",
  "seed"];
const state = { server: null, settings: {}, conversations: [], current: null, controller: null };

// 1) storage ---------------------------------------------------------------------------------
function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
    localStorage.setItem(STORE.current, state.current?.id ?? "");
  } catch { // the browser's quota (a few MB per site)
    notice("This browser's storage is full: delete old conversations to keep new ones.");
  }
}

// 2) conversations ---------------------------------------------------------------------------
function newConversation() {
  if (state.current && !state.current.messages.length) return select(state.current);
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  const conversation = { id, title: "New chat", messages: [] };
  state.conversations.unshift(conversation);
  select(conversation);
}

function select(conversation) {
  state.current = conversation;
  save();
  document.body.classList.remove("sidebar-toggled");
  renderSidebar();
  renderMessages();
}

function remove(conversation) {
  state.conversations = state.conversations.filter((c) => c !== conversation);
  if (state.current !== conversation) {
    save();
    renderSidebar();
  } else if (state.conversations.length) {
    select(state.conversations[0]);
  } else {
    newConversation();
  }
}

function renderSidebar() {
  const busy = state.controller !== null;
  $("new-chat").disabled = busy;
  $("conversations").replaceChildren(...state.conversations.map((conversation) => {
    const open = el("button", { type: "button", class: "open" }, conversation.title);
    const drop = el("button", { type: "button", class: "delete icon",
      "aria-label": `Delete ${conversation.title}` }, "\u00d7");
    open.disabled = drop.disabled = busy;
    open.addEventListener("click", () => select(conversation));
    drop.addEventListener("click", () => remove(conversation));
    return el("li", { class: conversation === state.current ? "current" : "" }, open, drop);
  }));
}

// 3) messages --------------------------------------------------------------------------------
/** Draw the current conversation; returns each message's view. */
function renderMessages() {
  const messages = state.current.messages;
  const views = messages.map((message, i) => messageView(message, i === messages.length - 1));
  $("messages").replaceChildren(...views.map((view) => view.node));
  $("messages").lastElementChild?.scrollIntoView({ block: "end" });
  return views;
}

/** One message's element, and how to redraw it (at most once a frame while it streams). */
function messageView(message, isLast) {
  if (message.role === "user") {
    const images = imageStrip(message.images);
    const node = el("article", { class: "message user" }, ...(images ? [images] : []),
      el("div", { class: "content" }, message.content)); // text, never HTML
    return { node, schedule() {} };
  }
  const reasoningText = el("div", { class: "reasoning-text" });
  const reasoning = el("details", { class: "reasoning" }, el("summary", {}, "Reasoning"),
    reasoningText);
  const progress = el("p", { class: "progress", role: "status" });
  const content = el("div", { class: "content markdown" });
  const raw = el("pre", { class: "raw" });
  const error = el("p", { class: "error", role: "alert" });
  const stats = el("span", { class: "stats" });
  const rawToggle = el("button", { type: "button", class: "raw-toggle" }, "Raw");
  const copy = el("button", { type: "button", class: "copy-message" }, "Copy");
  const footer = el("footer", {}, stats, rawToggle, copy);
  raw.hidden = true;
  rawToggle.addEventListener("click", () => {
    raw.hidden = !raw.hidden;
    content.hidden = !raw.hidden;
    rawToggle.textContent = raw.hidden ? "Raw" : "Rendered";
  });
  copy.addEventListener("click", () => copyText(message.content, copy));
  if (isLast && message.state !== "streaming") {
    const again = el("button", { type: "button", class: "regenerate" }, "Regenerate");
    again.addEventListener("click", regenerate);
    footer.append(again);
  }
  const node = el("article", { class: "message assistant" }, reasoning, progress, content, raw,
    error, footer);
  const update = () => {
    node.dataset.state = message.state;
    reasoning.hidden = !message.reasoning;
    reasoningText.textContent = message.reasoning;
    // a long prompt is computed in chunks before the first token: say how far it is
    const prompt = message.state === "streaming" ? message.progress : null;
    progress.hidden = !prompt || prompt.processed >= prompt.total;
    progress.textContent = prompt ? `processing prompt: ${prompt.processed}/${prompt.total}` : "";
    renderMarkdown(content, message.content);
    raw.textContent = message.content;
    error.hidden = !message.error;
    error.textContent = message.error ?? "";
    stats.replaceChildren(...statParts(message.stats));
  };
  update();
  let pending = false;
  return {
    node,
    schedule() { // tokens come faster than frames: draw once per frame
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; update(); });
    },
  };
}

function statParts(stats) {
  if (!stats) return [];
  const parts = [];
  if (stats.ttft_ms !== null && stats.ttft_ms !== undefined) {
    parts.push(el("span", { class: "ttft" }, `first token ${Math.round(stats.ttft_ms)} ms`));
  }
  if (stats.tokens_per_s) {
    parts.push(el("span", { class: "tps" }, `${stats.tokens_per_s.toFixed(1)} tok/s`));
  }
  if (stats.tokens) parts.push(el("span", { class: "tokens" }, `${stats.tokens} tokens`));
  parts.push(el("span", { class: "finish" }, `finish: ${stats.finish}`));
  return parts;
}

// 4) sending ---------------------------------------------------------------------------------
function requestBody(messages) {
  const settings = state.settings;
  const sent = settings.system?.trim() ? [{ role: "system", content: settings.system }] : [];
  for (const m of messages) {
    if (!(m.role === "assistant" && m.error && !m.content)) { // a failed answer says nothing
      // earlier turns keep their images: the prefix cache hashes pixels, so a resent one is
      // found there, not encoded again
      sent.push({ role: m.role, content: m.role === "user" ? userContent(m) : m.content });
    }
  }
  const body = { messages: sent, stream: true, return_progress: true, // llama-server's
    stream_options: { include_usage: true, continuous_usage_stats: true } };
  if (state.server) body.model = state.server.model;
  for (const name of FIELDS) {
    if (settings[name] !== null && settings[name] !== undefined) body[name] = settings[name];
  }
  return body;
}

async function generate() {
  const conversation = state.current;
  const body = requestBody(conversation.messages);
  const answer = { role: "assistant", content: "", reasoning: "", state: "streaming" };
  conversation.messages.push(answer);
  state.controller = new AbortController();
  setBusy(true);
  const view = renderMessages().at(-1);
  try {
    answer.stats = await streamAnswer(body, answer, view.schedule, state.controller.signal);
  } catch (error) {
    answer.error = `The server could not be reached (${error.message}).`;
    answer.stats = { finish: "error" };
  }
  answer.state = answer.stats.finish === "stopped" ? "stopped" : answer.error ? "error" : "done";
  delete answer.progress; // shown while streaming only: not kept with the conversation
  state.controller = null;
  save();
  setBusy(false);
  renderMessages();
}

async function send() {
  const text = $("input").value;
  if ((!text.trim() && !hasAttached()) || state.controller) return;
  if (!state.server) await loadDefaults(); // they failed at start (say, no key given then)
  const conversation = state.current;
  if (!conversation.messages.length) conversation.title = text.trim().slice(0, 40) || "Image";
  const message = { role: "user", content: text };
  const images = takeAttached();
  if (images.length) message.images = images;
  conversation.messages.push(message);
  $("input").value = "";
  generate();
}

function regenerate() {
  const messages = state.current.messages;
  if (state.controller || messages.at(-1)?.role !== "assistant") return;
  messages.pop();
  generate();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  renderSidebar();
}

// 5) settings --------------------------------------------------------------------------------
function showSettings() {
  $("system").value = state.settings.system ?? "";
  for (const name of FIELDS) $(name).value = state.settings[name] ?? "";
}

function readSettings() {
  const settings = { model: state.server?.model, system: $("system").value };
  for (const name of FIELDS) {
    const value = $(name).value.trim();
    settings[name] = value === "" ? null : Number(value);
  }
  state.settings = settings;
  localStorage.setItem(STORE.settings, JSON.stringify(settings));
}

function defaultSettings() {
  return { model: state.server.model, system: "", ...state.server.sampling, seed: null };
}

// the models the server holds, with their states: a picker where there is more than one
async function loadModels() {
  let response;
  try {
    response = await apiFetch("/v1/models");
  } catch {
    return;
  }
  if (!response.ok) return;
  const models = (await response.json()).data;
  const picker = $("model-picker");
  picker.hidden = models.length < 2;
  if (picker.hidden) return;
  const chosen = localStorage.getItem(STORE.model);
  picker.replaceChildren(...models.map((m) => {
    const state = m.status?.value;
    return el("option", { value: m.id }, state ? `${m.id} (${state})` : m.id);
  }));
  const loaded = models.find((m) => m.status?.value === "loaded");
  picker.value = models.some((m) => m.id === chosen) ? chosen : (loaded ?? models[0]).id;
}

async function loadDefaults() {
  const picker = $("model-picker");
  const query = picker.hidden ? "" : `?model=${encodeURIComponent(picker.value)}`;
  let response;
  try {
    response = await apiFetch(`/web/defaults${query}`);
  } catch (error) {
    return notice(`The server could not be reached (${error.message}).`);
  }
  if (!response.ok) return notice(await errorText(response));
  notice("");
  state.server = await response.json();
  $("model-name").textContent = picker.hidden ? state.server.model : "";
  document.title = `${state.server.model} \u00b7 nanoserve`;
  const stored = load(STORE.settings, null);
  state.settings = stored?.model === state.server.model ? stored : defaultSettings();
  showSettings();
  $("defaults-source").textContent = state.server.source === "model"
    ? "Defaults: the model's own sampling settings (its generation config)."
    : "Defaults: nanoserve's chat preset (the model names no sampling settings).";
  await checkImages(state.server.model);
  document.body.dataset.ready = "true";
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

// 6) start -----------------------------------------------------------------------------------
function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  wireAttachments($("input"), notice);
  $("model-picker").addEventListener("change", async () => {
    localStorage.setItem(STORE.model, $("model-picker").value);
    state.server = null; // the new model's defaults (it loads now, if it is not loaded)
    document.body.dataset.ready = "false";
    await loadDefaults();
  });
  $("new-chat").addEventListener("click", newConversation);
  $("toggle-sidebar").addEventListener("click",
    () => document.body.classList.toggle("sidebar-toggled"));
  $("toggle-settings").addEventListener("click",
    () => document.body.classList.toggle("settings-toggled"));
  $("settings").addEventListener("input", readSettings);
  $("reset-settings").addEventListener("click", () => {
    if (!state.server) return;
    state.settings = defaultSettings();
    showSettings();
    readSettings();
  });
}

async function start() {
  wire();
  state.conversations = load(STORE.conversations, []);
  for (const c of state.conversations) { // an answer cut off when the page was closed
    for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
  }
  const currentId = localStorage.getItem(STORE.current);
  const current = state.conversations.find((c) => c.id === currentId) ?? state.conversations[0];
  if (current) select(current);
  else newConversation();
  $("input").focus();
  await loadModels();
  await loadDefaults();
}

start();
