// The dashboard: polls /metrics (Prometheus text, with the API key when the server has one)
// every second (`/dashboard?interval=0.25` polls faster) and plots the last 120 scrapes. Behind
// --models-dir the series of every loaded model arrive together, each labelled `model_name`:
// a picker shows one model's (`/dashboard?model=NAME`) or all of them summed.

import { apiFetch, el, errorText } from "./common.js";
import { plot } from "./plot.js";

const P = "nanoserve:";
const INTERVAL_MS = 1000 * Math.max(0.1,
  Number(new URLSearchParams(location.search).get("interval")) || 1);
const POINTS = 120; // two minutes of one-second points
const PERCENTILE_WINDOW_S = 60;
const history = []; // {t: seconds, metrics: Map}, long enough for the percentile window
const series = { running: [], waiting: [], tps: [], kv: [], prefix: [], acceptance: [],
  ttft: [[], [], []], itl: [[], [], []] };
const $ = (id) => document.getElementById(id);
let chosenModel = new URLSearchParams(location.search).get("model") ?? ""; // "": all
const modelsSeen = new Set();

/** Prometheus text -> Map(sample name -> [{labels, value}]), of the chosen model only. */
function parse(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue; // comments, blank lines
    const labels = Object.fromEntries([...(m[2] ?? "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)]
      .map((l) => [l[1], l[2]]));
    if (labels.model_name !== undefined) {
      modelsSeen.add(labels.model_name);
      if (chosenModel && labels.model_name !== chosenModel) continue;
    }
    if (!samples.has(m[1])) samples.set(m[1], []);
    samples.get(m[1]).push({ labels, value: Number(m[3]) });
  }
  return samples;
}

const total = (metrics, name) => (metrics.get(name) ?? []).reduce((s, x) => s + x.value, 0);

/** A histogram's cumulative bucket counts, summed over label sets: [[upper bound, count]]. */
function buckets(metrics, name) {
  const counts = new Map();
  for (const { labels, value } of metrics.get(`${name}_bucket`) ?? []) {
    const le = labels.le === "+Inf" ? Infinity : Number(labels.le);
    counts.set(le, (counts.get(le) ?? 0) + value);
  }
  return [...counts].sort((a, b) => a[0] - b[0]);
}

/** Prometheus' histogram_quantile: linear within the bucket that holds the rank. */
function quantile(q, cumulative) {
  const count = cumulative.at(-1)?.[1] ?? 0;
  if (count <= 0) return null;
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const [upper, seen] of cumulative) {
    if (seen >= rank) {
      if (upper === Infinity) return lower;
      return lower + ((upper - lower) * (rank - below)) / Math.max(seen - below, 1e-12);
    }
    [lower, below] = [upper, seen];
  }
  return lower;
}

/** The bucket counts added since `past` (the last minute's observations). */
function since(now, past) {
  const before = new Map(past);
  return now.map(([le, count]) => [le, Math.max(count - (before.get(le) ?? 0), 0)]);
}

function push(list, value) {
  list.push(value);
  if (list.length > POINTS) list.shift();
}

function update(metrics) {
  const t = performance.now() / 1000;
  const last = history.at(-1);
  // generation_tokens counts tokens as they are generated, so its rate includes requests still
  // running
  const generated = (m) => total(m, `${P}generation_tokens_total`);
  // speculative decoding: draft tokens proposed and kept (vLLM's spec_decode counters)
  const drafted = (m) => total(m, `${P}spec_decode_num_draft_tokens_total`);
  const kept = (m) => total(m, `${P}spec_decode_num_accepted_tokens_total`);
  let tps = null;
  let hitRate = null;
  let keptRate = null;
  if (last) {
    const newDrafts = drafted(metrics) - drafted(last.metrics);
    keptRate = newDrafts > 0 ? (100 * (kept(metrics) - kept(last.metrics))) / newDrafts : null;
    const dt = t - last.t;
    tps = Math.max(generated(metrics) - generated(last.metrics), 0) / dt;
    const queries = total(metrics, `${P}prefix_cache_queries_total`)
      - total(last.metrics, `${P}prefix_cache_queries_total`);
    const hits = total(metrics, `${P}prefix_cache_hits_total`)
      - total(last.metrics, `${P}prefix_cache_hits_total`);
    hitRate = queries > 0 ? (100 * hits) / queries : null;
  }
  history.push({ t, metrics });
  while (history.length > 2 && t - history[1].t >= PERCENTILE_WINDOW_S) history.shift();

  const running = total(metrics, `${P}num_requests_running`);
  const waiting = total(metrics, `${P}num_requests_waiting`);
  const kv = 100 * total(metrics, `${P}kv_cache_usage_perc`);
  push(series.running, running);
  push(series.waiting, waiting);
  push(series.tps, tps);
  push(series.kv, kv);
  push(series.prefix, hitRate);
  push(series.acceptance, keptRate);
  show("requests", `${running} running \u00b7 ${waiting} waiting`, running,
    [series.running, series.waiting]);
  show("tokens", tps === null ? "\u2013" : `${tps.toFixed(1)} tok/s`, tps ?? 0, [series.tps]);
  show("kv-cache", `${kv.toFixed(1)} %`, kv, [series.kv], 100);
  const queried = total(metrics, `${P}prefix_cache_queries_total`);
  const overall = queried > 0 ? (100 * total(metrics, `${P}prefix_cache_hits_total`)) / queried
    : 0;
  show("prefix-cache", `${overall.toFixed(0)} % since start`, overall, [series.prefix], 100);
  acceptance(metrics, drafted(metrics), kept(metrics));
  latency("ttft", metrics, `${P}time_to_first_token_seconds`);
  latency("itl", metrics, `${P}inter_token_latency_seconds`);
  showModels();
  status(`updated ${new Date().toLocaleTimeString()}`);
}

/** The share of draft tokens kept since start, and the tokens a drafting step commits. */
function acceptance(metrics, drafted, kept) {
  const steps = total(metrics, `${P}spec_decode_num_drafts_total`);
  const share = drafted > 0 ? (100 * kept) / drafted : 0;
  const text = drafted > 0
    ? `${share.toFixed(0)} % kept \u00b7 ${(1 + kept / steps).toFixed(2)} tokens a drafting step`
    : "no draft tokens yet (speculative decoding off, or nothing to draft)";
  show("acceptance", text, share, [series.acceptance], 100);
}

/** p50, p90 and p99 of a latency histogram over the last minute, in milliseconds. */
function latency(id, metrics, name) {
  const recent = since(buckets(metrics, name), buckets(history[0].metrics, name));
  const values = [0.5, 0.9, 0.99].map((q) => {
    const seconds = quantile(q, recent);
    return seconds === null ? null : seconds * 1000;
  });
  values.forEach((v, k) => push(series[id][k], v));
  const text = values[0] === null ? "nothing in the last minute"
    : `${values.map((v) => v.toFixed(v < 10 ? 1 : 0)).join(" \u00b7 ")} ms`;
  show(id, text, values[0] ?? 0, series[id]);
}

function show(id, text, value, lines, floor = 1) {
  const card = $(id);
  let svg = card.querySelector("svg");
  if (!svg) {
    svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", card.querySelector("h2").textContent);
    card.append(svg);
  }
  const valueNode = card.querySelector(".value");
  valueNode.textContent = text;
  valueNode.dataset.value = String(value); // the number itself, for tests and scripts
  const top = plot(svg, lines, POINTS, floor);
  svg.dataset.top = String(top);
}

/** The picker of models (shown once the metrics name more than one) and the title. */
function showModels() {
  const picker = $("model-filter");
  const names = [...modelsSeen].sort();
  if (names.length > 1 || chosenModel) {
    const have = [...picker.options].map((o) => o.value).slice(1);
    if (have.join("\n") !== names.join("\n")) {
      picker.replaceChildren(el("option", { value: "" }, "All models"),
        ...names.map((name) => el("option", { value: name }, name)));
    }
    picker.value = chosenModel;
    picker.hidden = false;
  }
  const shown = chosenModel || (names.length === 1 ? names[0] : "");
  if (shown) $("title").textContent = `${shown} \u00b7 nanoserve dashboard`;
  else if (names.length > 1) {
    $("title").textContent = `${names.length} models \u00b7 nanoserve dashboard`;
  }
}

$("model-filter").addEventListener("change", () => {
  chosenModel = $("model-filter").value;
  history.length = 0; // the plots start again, with the chosen model's series
  for (const list of Object.values(series)) {
    if (Array.isArray(list[0])) for (const inner of list) inner.length = 0;
    else list.length = 0;
  }
});

function status(text, ...extra) {
  $("status").replaceChildren(text, ...extra);
}

async function poll() {
  let response;
  try {
    response = await apiFetch("/metrics");
  } catch {
    status("the server is not answering");
    return setTimeout(poll, INTERVAL_MS);
  }
  if (response.status === 401) { // the key dialog was cancelled: wait for the person
    const retry = el("button", { type: "button" }, "Enter the API key");
    retry.addEventListener("click", poll);
    return status("this server needs an API key ", retry);
  }
  if (!response.ok) {
    status(await errorText(response));
  } else {
    update(parse(await response.text()));
  }
  setTimeout(poll, INTERVAL_MS);
}

$("about").textContent = `From /metrics every ${INTERVAL_MS / 1000} s; the plots show the `
  + `last ${Math.round((POINTS * INTERVAL_MS) / 1000)} s, percentiles the last minute.`;
poll();
