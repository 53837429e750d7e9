// Rendering of prefixd's JSON (backends, lanes, prefix reports) into DOM nodes, always with
// text nodes: reports carry prompt excerpts, which are untrusted. Used by app.js.

export const DASH = "—";
export const REUSING = new Set(["IDENTICAL", "APPEND", "APPEND+ECHO_DRIFT", "BOUNDARY"]);

// An element; strings among children become text nodes, props become attributes.
export function el(tag, props, ...children) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") n.className = v;
    else n.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    n.append(c instanceof Node ? c : String(c));
  }
  return n;
}

const list = (x) => x || [];
export const num = (n) => (typeof n === "number" ? n.toLocaleString("en-US") : DASH);
export const plural = (n, one, many) => `${num(n)} ${n === 1 ? one : many || one + "s"}`;
export function bytes(n) {
  if (typeof n !== "number") return DASH;
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n >= 100 || i === 0 ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}
export function secs(s) {
  if (typeof s !== "number") return DASH;
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  return s < 60 ? `${s.toFixed(1)} s` : `${(s / 60).toFixed(1)} min`;
}
export function idle(s) {
  if (typeof s !== "number") return DASH;
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}
export const sent = (r) => r.sent_verdict || r.verdict;
const vclass = (v) => "v-" + String(v || "none").toLowerCase().replace(/[^a-z]+/g, "-");
export const badge = (v, title) => el("span", { class: "badge " + vclass(v), title }, v || DASH);

// The canonicalization rules as /ui/rules.json serves them (from their registry,
// proxy/prefix/rules.py): cause -> the rule that fixes it, rule -> its setting and text.
export function ruleBook(data) {
  const rules = new Map(list(data && data.rules).map((x) => [x.name, x]));
  return {
    fixes: (data && data.fixes) || {},
    setting: (rule) => (rules.get(rule) || {}).setting || rule,
    doc: (rule) => (rules.get(rule) || {}).doc || null,
  };
}

function reusePct(r) {
  if (!r || r.verdict === "NEW") return null;
  if (!r.prev_prompt_tokens) return REUSING.has(sent(r)) ? 100 : 0;
  return Math.max(0, Math.min(100, (100 * r.reusable_tokens) / r.prev_prompt_tokens));
}

// The client's verdict, and what the backend got when canonicalization changed it.
export function verdicts(r) {
  const out = [badge(r.verdict, r.sent_verdict ? "what the client sent" : null)];
  if (r.sent_verdict && r.sent_verdict !== r.verdict) {
    out.push(el("span", { class: "arrow" }, "→"),
      badge(r.sent_verdict, "what the backend received after canonicalization"));
  }
  return out;
}

export function bars(reports, big) {
  const box = el("span", { class: "bars" + (big ? " big" : ""), role: "img",
    "aria-label": "reuse per turn" });
  for (const r of reports) {
    const pct = reusePct(r);
    const label = pct === null ? "new" : `${Math.round(pct)}% reused`;
    const causes = (r.causes || []).length ? " · " + r.causes.join(", ") : "";
    const bar = el("span", { class: "bar " + vclass(sent(r)), "data-turn": r.turn,
      "data-reuse": pct === null ? "new" : Math.round(pct),
      title: `turn ${r.turn}: ${sent(r)} · ${label}${causes}` }, el("span", { class: "fill" }));
    bar.firstChild.style.height = pct === null ? "100%" : `${Math.max(pct, 3)}%`;
    if (!big) { box.append(bar); continue; }
    bar.addEventListener("click", () => {
      const card = document.getElementById("turn-" + r.turn);
      if (card) card.scrollIntoView({ behavior: "smooth" });
    });
    box.append(el("span", { class: "col" }, bar,
      el("span", { class: "lbl" }, pct === null ? "new" : `${Math.round(pct)}%`),
      el("span", { class: "lbl muted" }, `#${r.turn}`)));
  }
  return box;
}

export function meter(used, total) {
  const m = el("span", { class: "meter" }, el("span", { class: "fill" }));
  m.firstChild.style.width = `${Math.min(100, total ? (100 * used) / total : 0)}%`;
  return m;
}

function row(label, ...value) {
  return el("div", { class: "kv" }, el("span", { class: "k" }, label),
    el("span", { class: "v" }, ...value));
}

// old/new excerpts with the part that differs marked (common head and tail left plain).
function excerpt(oldText, newText) {
  const a = Array.from(oldText), b = Array.from(newText);
  let p = 0;
  while (p < a.length && p < b.length && a[p] === b[p]) p += 1;
  let q = 0;
  const same = (i) => a[a.length - 1 - i] === b[b.length - 1 - i];
  while (q < a.length - p && q < b.length - p && same(q)) q += 1;
  const visible = (t) => (t.trim() ? t : t.replace(/ /g, "·").replace(/\n/g, "↵\n"));
  const line = (sign, chars, cls) => el("pre", { class: "excerpt " + cls },
    el("span", { class: "sign" }, sign), chars.slice(0, p).join(""),
    el("mark", {}, visible(chars.slice(p, chars.length - q).join(""))),
    chars.slice(chars.length - q).join(""));
  return el("div", { class: "excerpts" }, line("−", a, "old"), line("+", b, "new"));
}

const codes = (rules, book) => rules.flatMap((x, i) => [i ? " " : null,
  el("code", { title: book.doc(x) }, `${book.setting(x)}=on`)]);

// What was done about a break, and what would fix it.
function fixRows(r, book) {
  const out = [];
  if (list(r.fixed).length) {
    out.push(row("fixed by", r.fixed.join(", "), ` · kept ${num(r.saved_tokens)} tok`));
  }
  for (const w of list(r.would_fix)) {
    out.push(row("would fix", ...codes([w.rule], book),
      ` keeps ${num(w.saved_tokens)} more tok`,
      w.mode === "dry_run" ? " (dry run)" : " (rule off; measured on a copy)"));
  }
  const done = new Set([...list(r.fixed),
    ...list(r.would_fix).map((w) => w.rule)]);
  const rules = REUSING.has(sent(r)) ? []
    : [...new Set(list(r.causes).map((c) => book.fixes[c]).filter((x) => x && !done.has(x)))];
  if (rules.length) out.push(row("fix", ...codes(rules, book)));
  const fixShown = rules.length || list(r.would_fix).length;
  if (r.hint && !(fixShown && r.hint.startsWith("canon_"))) out.push(row("hint", r.hint));
  return out;
}

function spanBlock(s) {
  const where = el("div", { class: "small" }, el("code", {}, `${s.path} +${num(s.char_offset)} ch`),
    " ", list(s.causes).join(", ") || "?", s.old_excerpt == null
      ? el("span", { class: "muted" }, ` · old #${s.old_hash} → new #${s.new_hash}`) : null);
  return el("div", { class: "span" }, where,
    s.old_excerpt != null ? excerpt(s.old_excerpt, s.new_excerpt || "") : null);
}

export function turnCard(r, book) {
  const pct = reusePct(r);
  const kv = [];
  if (r.path) {
    const approx = r.token_offset_exact ? "" : "~";
    kv.push(row("where", el("code", {}, `${r.path} +${num(r.char_offset)} ch`),
      ` · token ${approx}${num(r.token_offset)}`,
      approx ? el("span", { class: "muted small" }, " (estimated)") : null));
  }
  if (r.verdict !== "NEW") {
    kv.push(row("reused", meter(r.reusable_tokens, r.prev_prompt_tokens),
      `${num(r.reusable_tokens)} / ${num(r.prev_prompt_tokens)} tok`,
      pct === null ? "" : ` (${pct.toFixed(1)}%)`,
      r.lost_tokens ? ` · lost ${num(r.lost_tokens)} tok` : ""));
  }
  if (r.moved_from || r.moved_to) {
    kv.push(row("moved", `${r.moved_from || "?"} → ${r.moved_to || "?"}`));
  }
  if (list(r.tools_added).length) kv.push(row("tools added", r.tools_added.join(", ")));
  if (list(r.tools_removed).length) kv.push(row("tools removed", r.tools_removed.join(", ")));
  kv.push(...fixRows(r, book));
  if (typeof r.backend_cached_tokens === "number") {
    kv.push(row("backend cached",
      `${num(r.backend_cached_tokens)} / ${num(r.backend_prompt_tokens)} tok · `,
      el("span", { class: r.miss === "unexplained" ? "error" : "ok" }, r.miss || "agrees"),
      list(r.suspects).length ? ` (suspects: ${r.suspects.join(", ")})` : ""));
  }
  const spans = list(r.spans).map(spanBlock);
  if (spans.length && r.spans.every((s) => s.old_excerpt == null)) {
    spans.push(el("p", { class: "muted small" },
      "Set PREFIXD_PREFIX_EXCERPTS=true to see the text around the change."));
  }
  return el("article", { class: "card turn", id: "turn-" + r.turn, "data-turn": r.turn },
    el("header", {}, el("h3", {}, `Turn ${r.turn}`), ...verdicts(r),
      list(r.causes).map((c) => el("span", { class: "chip" }, c))),
    ...kv, ...spans);
}
