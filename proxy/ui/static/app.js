// prefixd status page. Polls /status, /debug/prefix and /debug/prefix/{lane} every 2 s, and
// reads the canonicalization rules once from /ui/rules.json; the DOM is built by render.js.
// No build step: an ES module the browser loads as is.

import {
  DASH, REUSING, el, num, plural, bytes, idle, secs, sent,
  badge, verdicts, bars, meter, turnCard, ruleBook,
} from "./render.js";

const POLL_MS = 2000;
const KEY = "prefixd.apiKey";
const MAX_LANES = 20;          // the most recently active lanes get a per-turn chart
const $ = (sel) => document.querySelector(sel);
let timer = null;
let gen = 0;
let rules = null;              // ruleBook of /ui/rules.json, once loaded

class Unauthorized extends Error {}

async function getJSON(path) {
  const headers = { Accept: "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) headers.Authorization = "Bearer " + key;
  const r = await fetch(path, { headers, cache: "no-store" });
  if (r.status === 401) throw new Unauthorized("unauthorized");
  const body = await r.json().catch(() => null);
  if (!r.ok) {
    const err = new Error((body && body.error && body.error.message) || "HTTP " + r.status);
    err.status = r.status;
    throw err;
  }
  return body;
}

// Totals over the reports on the page: reuse, tokens lost, tokens kept by the rules.
function totals(histories) {
  const reports = histories.flat().filter(Boolean);
  const sum = (f) => reports.reduce((s, r) => s + (f(r) || 0), 0);
  const prev = sum((r) => (r.verdict === "NEW" ? 0 : r.prev_prompt_tokens));
  const reused = sum((r) => (r.verdict === "NEW" ? 0 : r.reusable_tokens));
  const broke = reports.filter((r) => r.verdict !== "NEW" && !REUSING.has(sent(r))).length;
  const stat = (value, label) => el("div", { class: "stat" }, el("strong", {}, value),
    el("span", { class: "muted" }, label));
  return [stat(num(reports.length), "turns reported"),
    stat(prev ? `${Math.round((100 * reused) / prev)}%` : DASH, "of previous prompts reused"),
    stat(num(broke), "turns broke the prefix"),
    stat(`${num(sum((r) => r.lost_tokens))} tok`, "lost to changes"),
    stat(`${num(sum((r) => r.saved_tokens))} tok`, "kept by canonicalization")];
}

function cacheCell(c) {
  if (!c) return el("span", { class: "muted" }, DASH);
  const budget = c.budget ?? c.bytes_budget;
  const count = (x) => (Array.isArray(x) ? x.length : x);
  const misses = Object.entries(c.misses || {}).map(([k, v]) => `${v} ${k}`).join(", ");
  return el("div", { class: "cache" }, meter(c.bytes_used, budget),
    el("span", {}, `${bytes(c.bytes_used)} / ${bytes(budget)}`),
    el("div", { class: "muted small" }, `${plural(count(c.entries), "entry", "entries")} · ` +
      `${plural(count(c.checkpoints), "checkpoint")} · ${num(c.hit_tokens_total)} hit tok`),
    c.disk ? el("div", { class: "muted small" }, `disk ${bytes(c.disk.bytes_used)} / ` +
      `${bytes(c.disk.budget)} · ${plural(c.disk.records, "record")}`) : null,
    c.batch && c.batch.decode_passes ? el("div", { class: "muted small", title: "requests " +
      "per decode forward pass (batched decode): last / mean / largest" },
      `decode batch ${num(c.batch.last_decode_batch)} · mean ${c.batch.mean_decode_batch} · ` +
      `max ${num(c.batch.largest_decode_batch)}`) : null,
    c.speculative && c.speculative.verify_passes ? el("div", { class: "muted small", title:
      "speculative decoding: drafted tokens accepted / drafted, in verify passes (and of " +
      "them the model's own MTP head's or a draft model's)" },
      `drafts ${num(c.speculative.accepted)} / ${num(c.speculative.drafted)} accepted · ` +
      `${plural(c.speculative.verify_passes, "verify pass", "verify passes")}` +
      [["mtp", "MTP head"], ["model", "draft model"]].filter(([k]) =>
        (c.speculative.by_source || {})[k]).map(([k, name]) => ` · ${name} ` +
        `${num(c.speculative.by_source[k].accepted)} / ` +
        `${num(c.speculative.by_source[k].drafted)}`).join("")) : null,
    refusedLine((c.speculative || {}).refused),
    misses ? el("div", { class: "muted small" }, `misses: ${misses}`) : null,
    c.group ? el("div", { class: "muted small" }, `group, ${c.group.parallel || DASH}-parallel: ` +
      (c.group.ranks || []).map((r) => `rank ${r.rank} ${r.host} ` +
        bytes((r.memory || {}).rss_bytes)).join(" · ")) : null);
}

// A managed llama-server's slots (kind llama): what each holds, where requests were pinned
// and why, and the slot files its slots move through (saved, restored, misses by why).
function slotsCell(b) {
  const k = b.llama_slots, f = b.slot_files;
  if (!k && !f) return null;
  const slots = (k && k.slots) || [];
  const p = (k && k.placements) || {};
  const held = slots.filter((s) => s.tokens).length;
  const busy = slots.filter((s) => s.busy).length;
  const misses = Object.entries((f && f.counts) || {})
    .filter(([key]) => ["missing", "damaged", "foreign", "stale"].includes(key))
    .map(([key, v]) => `${v} ${key}`).join(", ");
  return el("div", { class: "cache" },
    el("span", { title: "tokens each slot holds (* saved in a slot file)" },
      `${plural(slots.length, "slot")}: ` + (slots.map((s) => `${num(s.tokens)}` +
        (s.saved && s.tokens ? "*" : "")).join(" · ") || DASH)),
    el("div", { class: "muted small" }, `${held} held · ${busy} busy · pinned: ` +
      (["holds_prefix", "copy", "restore", "fresh"].map((r) => `${num(p[r] || 0)} ${r}`).join(", "))),
    el("div", { class: "muted small" }, `saves ${num(p.save_saved || 0)} · restores ` +
      `${num(p.restore_hit || 0)} hit` + Object.entries(p).filter(([key]) =>
        key.startsWith("restore_") && key !== "restore_hit")
        .map(([key, v]) => `, ${v} ${key.slice(8)}`).join("")),
    f ? el("div", { class: "muted small" }, `slot files ${plural(f.files, "file")} · ` +
      `${bytes(f.bytes)} / ${bytes(f.budget_bytes)}`) : null,
    misses ? el("div", { class: "error small" }, `slot files dropped: ${misses}`) : null);
}

// Drafters the worker was asked for and refused at load (a damaged head file, a draft model
// whose tokenizer is not the served model's...), each with why: it serves without them.
function refusedLine(refused) {
  const all = Object.entries(refused || {});
  if (!all.length) return null;
  return el("div", { class: "error small", title: "speculative decoding: drafters refused at " +
    "load (GET /v1/cache speculative.refused); prompt lookup still drafts" },
    all.map(([k, r]) => `${k === "mtp" ? "MTP head" : "draft model"} not used: ${r.reason}`)
      .join(" · "));
}

// A managed model's footprint against the memory budget (estimated until its worker measured
// it); a model that is not loaded holds none of it now.
const LOADED = new Set(["starting", "ready", "stopping"]);
function memoryCell(b) {
  if (typeof b.footprint_bytes !== "number") return el("span", { class: "muted" }, DASH);
  const held = LOADED.has(b.state);
  return el("div", { class: "cache" }, meter(held ? b.footprint_bytes : 0, b.memory_budget),
    el("span", {}, `${bytes(b.footprint_bytes)} / ${bytes(b.memory_budget)}`),
    el("div", { class: "muted small" },
      `${b.footprint_source || "estimate"}${held ? "" : " · not loaded"}`));
}

function modelMemory(mm) {
  if (!mm) return [];
  return [meter(mm.loaded_bytes, mm.budget_bytes), " ",
    `models loaded: ${bytes(mm.loaded_bytes)} of ${bytes(mm.budget_bytes)} ` +
    `(${(mm.loaded || []).join(", ") || "none"})`];
}

// What the proxy's prefix index says the backend holds (conversations by lane, largest
// first), and how the cached tokens the backend reported met the predictions.
function indexCell(ix) {
  if (!ix || !ix.entries) return el("span", { class: "muted" }, DASH);
  const top = (ix.top || []).map((t) =>
    el("div", { class: "small" }, el("a", { href: "#lane=" + encodeURIComponent(t.lane) },
      String(t.lane).slice(0, 14)), ` ${num(t.tokens)} tok`));
  return el("div", { class: "index" },
    el("span", {}, `${plural(ix.conversations, "conversation")} · ${num(ix.tokens)} tok`),
    el("div", { class: "muted small" }, `predicted ${num(ix.predicted_tokens)} / ` +
      `reported ${num(ix.reported_tokens)} cached tok` +
      (ix.mispredictions ? ` · ${plural(ix.mispredictions, "miss", "misses")}` : "") +
      (ix.transferred_tokens ? ` · ${num(ix.transferred_tokens)} tok copied in` : "")),
    ...top);
}

function backendRow(b) {
  const models = (b.models || []).join(", ");
  const state = b.state === "ready" && b.up === false ? "unhealthy" : b.state;
  return el("tr", { "data-backend": b.name },
    el("td", {}, el("strong", {}, b.name), " ", el("span", { class: "muted small" }, b.kind)),
    el("td", {}, el("span", { class: "state s-" + state }, state)),
    el("td", {}, models || DASH,
      b.model && b.model !== models ? el("div", { class: "muted small" }, b.model) : null),
    el("td", { class: "num" }, num(b.queue_depth)),
    el("td", { class: "num" }, `${num(b.in_flight)} / ${num(b.max_concurrency)}`),
    el("td", { class: "num", title: b.waited_n ? `time behind other requests, last ` +
      `${b.waited_n}: median / worst (prefixd's queue, then the worker's)` : "" },
      b.waited_n ? `${secs(b.waited_p50_s)} / ${secs(b.waited_max_s)}` : DASH),
    el("td", {}, memoryCell(b)),
    el("td", {}, b.kind === "llama" ? slotsCell(b) : cacheCell(b.cache)),
    el("td", {}, indexCell(b.index)),
    el("td", { class: "error small", title: b.last_error || "" },
      b.last_error ? String(b.last_error).slice(0, 90) : el("span", { class: "muted" }, DASH)));
}

function laneRow(lane, reports) {
  const last = reports && reports.length ? reports[reports.length - 1] : null;
  const saved = (reports || []).reduce((s, r) => s + (r.saved_tokens || 0), 0);
  const causes = last && last.causes && last.causes.length ? last.causes.join(", ") : "";
  return el("tr", { "data-lane": lane.lane },
    el("td", { class: "lane" }, el("a", { href: "#lane=" + encodeURIComponent(lane.lane) },
      lane.lane)),
    el("td", {}, lane.client || (last && last.client) || DASH),
    el("td", { class: "num" }, num(lane.turn)),
    el("td", { class: "num" }, idle(lane.idle_s)),
    el("td", { class: "verdict" }, last ? verdicts(last) : badge(lane.last_verdict),
      causes ? el("span", { class: "causes small" }, " " + causes) : null),
    el("td", {}, reports ? bars(reports, false) : el("span", { class: "muted" }, DASH)),
    el("td", { class: "num" }, saved ? `${num(saved)} tok` : el("span", { class: "muted" }, "0")));
}

const emptyRow = (cols, text) => el("tr", {}, el("td", { colspan: cols, class: "muted" }, text));

async function loadOverview() {
  const [status, lanes] = await Promise.all([getJSON("/status"), getJSON("/debug/prefix")
    .catch((e) => { if (e.status === 404) return null; throw e; })]);
  const recent = lanes ? [...lanes.lanes].sort((a, b) => a.idle_s - b.idle_s) : [];
  const histories = await Promise.all(recent.slice(0, MAX_LANES).map((l) =>
    getJSON("/debug/prefix/" + encodeURIComponent(l.lane)).then((h) => h.reports)
      .catch((e) => { if (e instanceof Unauthorized) throw e; return null; })));
  return () => {
    const backends = status.backends || [];
    $("#backends tbody").replaceChildren(...(backends.length ? backends.map(backendRow)
      : [emptyRow(10, "no backends")]));
    $("#model-memory").hidden = !status.model_memory;
    $("#model-memory").replaceChildren(...modelMemory(status.model_memory));
    const note = $("#lanes-note");
    note.hidden = lanes !== null;
    note.textContent = "Prefix detection is off (PREFIXD_PREFIX_DETECT=false).";
    $("#totals").replaceChildren(...(recent.length ? totals(histories) : []));
    $("#lanes tbody").replaceChildren(...(recent.length
      ? recent.map((l, i) => laneRow(l, histories[i]))
      : [emptyRow(7, lanes ? "no conversations yet" : DASH)]));
    show("#overview");
  };
}

async function loadLane(lane) {
  let data = null;
  rules = rules || ruleBook(await getJSON("/ui/rules.json"));
  const book = rules;
  try { data = await getJSON("/debug/prefix/" + encodeURIComponent(lane)); }
  catch (e) { if (e.status !== 404) throw e; }
  return () => {
    $("#lane-title").textContent = "Conversation " + lane;
    const reports = data ? data.reports : [];
    const first = reports[0], last = reports[reports.length - 1];
    const saved = reports.reduce((s, r) => s + (r.saved_tokens || 0), 0);
    $("#lane-summary").textContent = !data
      ? "This lane is not known (never seen, or forgotten after being idle)."
      : `client ${last ? last.client : DASH} · turns ${first ? first.turn : DASH}–` +
        `${last ? last.turn : DASH} · ${num(saved)} tok saved by canonicalization`;
    $("#lane-chart").replaceChildren(bars(reports, true));
    $("#turns").replaceChildren(...reports.slice().reverse().map((r) => turnCard(r, book)));
    show("#lane-view");
  };
}

function show(id) {
  for (const s of ["#login", "#overview", "#lane-view"]) $(s).hidden = s !== id;
}

function status(text, bad) {
  const u = $("#updated");
  u.textContent = text;
  u.className = bad ? "error" : "muted";
}

async function tick() {
  const mine = ++gen;
  clearTimeout(timer);
  const m = /^#lane=(.+)$/.exec(location.hash);
  let render;
  try {
    render = m ? await loadLane(decodeURIComponent(m[1])) : await loadOverview();
  } catch (e) {
    if (mine !== gen) return;
    if (e instanceof Unauthorized) {
      const refused = sessionStorage.getItem(KEY) !== null;
      sessionStorage.removeItem(KEY);
      $("#login-error").hidden = !refused;
      $("#login-error").textContent = "That key was refused.";
      show("#login");
      status("API key needed", true);
      return;                     // polling resumes when a key is entered
    }
    status("cannot reach prefixd: " + e.message, true);
    timer = setTimeout(tick, POLL_MS);
    return;
  }
  if (mine !== gen) return;
  render();
  status(`updated ${new Date().toLocaleTimeString("en-GB")} · every ${POLL_MS / 1000} s`);
  timer = setTimeout(tick, POLL_MS);
}

$("#login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("#key").value);
  $("#key").value = "";
  tick();
});
window.addEventListener("hashchange", tick);
tick();
