// halwatch web page: one answer or a JSONL file to /v1/score, results with the flagged spans highlighted and, with
// "Show sources", each answer sentence's sources in the context.
"use strict";

const $ = (id) => document.getElementById(id);

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

async function loadDetectors() {
  try {
    const r = await fetch("/v1/detectors", { headers: headers() });
    if (r.status === 401) {
      $("status").textContent = "This server needs an API key: enter it above.";
      $("status").className = "error";
      return;
    }
    if (!r.ok) return;
    if ($("status").className === "error") { $("status").textContent = ""; $("status").className = ""; }
    const data = await r.json();
    const select = $("detector");
    select.replaceChildren();
    for (const d of data.detectors) {
      const option = document.createElement("option");
      option.value = d.name;
      option.textContent = d.name + " (" + d.method + ")";
      option.selected = d.default;
      select.appendChild(option);
    }
  } catch (e) { /* the page still works with the server's default */ }
}

// Characters from..to of the answer as text nodes, with each flagged span in a <mark> whose title gives its
// confidence (spans clipped to the range).
function appendMarked(box, chars, from, to, spans) {
  let at = from;
  for (const s of [...spans].sort((a, b) => a.start - b.start)) {
    const start = Math.max(s.start, at), end = Math.min(s.end, to);
    if (end <= start) continue;
    if (start > at) box.appendChild(document.createTextNode(chars.slice(at, start).join("")));
    const mark = document.createElement("mark");
    mark.textContent = chars.slice(start, end).join("");
    mark.title = "confidence " + Number(s.confidence).toFixed(3);
    box.appendChild(mark);
    at = end;
  }
  if (at < to) box.appendChild(document.createTextNode(chars.slice(at, to).join("")));
}

// The answer, flagged spans marked; with evidence, each sentence is a focusable element whose sources light up in
// the context below it when hovered or clicked.
function highlighted(response, spans, evidence) {
  const box = document.createElement("div");
  box.className = "answer";
  const chars = Array.from(response); // offsets count Unicode code points
  if (!evidence) {
    appendMarked(box, chars, 0, chars.length, spans);
    return box;
  }
  let at = 0;
  evidence.forEach((sentence, i) => {
    appendMarked(box, chars, at, sentence.start, spans);
    const el = document.createElement("span");
    el.className = "sentence" + (sentence.supported ? "" : " flagged");
    el.dataset.index = String(i);
    el.tabIndex = 0;
    appendMarked(el, chars, sentence.start, sentence.end, spans);
    box.appendChild(el);
    at = sentence.end;
  });
  appendMarked(box, chars, at, chars.length, spans);
  return box;
}

// The context (or prompt) the sources point into, each source sentence in a <span class="source">.
function sourcesBox(text, evidence) {
  const box = document.createElement("div");
  box.className = "context";
  const chars = Array.from(text || "");
  const ranges = new Map();
  for (const sentence of evidence) for (const s of sentence.sources) ranges.set(s.start + "-" + s.end, s);
  let at = 0;
  for (const s of [...ranges.values()].sort((a, b) => a.start - b.start)) {
    if (s.start < at) continue;
    if (s.start > at) box.appendChild(document.createTextNode(chars.slice(at, s.start).join("")));
    const el = document.createElement("span");
    el.className = "source";
    el.dataset.range = s.start + "-" + s.end;
    el.textContent = chars.slice(s.start, s.end).join("");
    box.appendChild(el);
    at = s.end;
  }
  if (at < chars.length) box.appendChild(document.createTextNode(chars.slice(at).join("")));
  return box;
}

// Hovering, focusing or clicking an answer sentence lights its sources (their weights as titles), or says that a
// flagged sentence has none.
function linkSources(card, evidence) {
  const note = card.querySelector(".evidence-note");
  const light = (i) => {
    for (const el of card.querySelectorAll(".lit")) { el.classList.remove("lit"); el.removeAttribute("title"); }
    const sentence = evidence[i];
    card.querySelector(".sentence[data-index='" + i + "']").classList.add("lit");
    for (const s of sentence.sources) {
      const el = card.querySelector(".source[data-range='" + s.start + "-" + s.end + "']");
      if (el) { el.classList.add("lit"); el.title = "weight " + Number(s.weight).toFixed(3); }
    }
    note.textContent = sentence.supported
      ? "Support " + Number(sentence.support).toFixed(3) + ": " + sentence.sources.length + " source" +
        (sentence.sources.length === 1 ? "" : "s") + " highlighted in the context."
      : "No evidence: this sentence holds words flagged as unsupported (support " +
        Number(sentence.support).toFixed(3) + ").";
  };
  for (const el of card.querySelectorAll(".sentence")) {
    const i = Number(el.dataset.index);
    for (const type of ["mouseenter", "focus", "click"]) el.addEventListener(type, () => light(i));
  }
}

function show(result, item) {
  const card = document.createElement("div");
  card.className = "result";
  const head = document.createElement("div");
  const verdict = document.createElement("span");
  verdict.className = "verdict " + (result.hallucinated ? "bad" : "good");
  verdict.textContent = result.hallucinated ? "Hallucinated" : "Supported";
  const score = document.createElement("span");
  score.className = "score";
  score.textContent = " probability " + result.score.toFixed(4) + " (threshold " + result.threshold.toFixed(4) + ")";
  head.append(verdict, score);
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.textContent = "id " + result.id + " · " + result.detector + " on " + result.scoring_model + " (" +
    result.input_mode + ")" + (result.truncated ? " · " + result.truncated + " context tokens cut to fit" : "") +
    " · " + result.spans.length + " flagged span" + (result.spans.length === 1 ? "" : "s");
  card.append(head, meta, highlighted(item.response, result.spans, result.evidence));
  if (result.evidence) {
    const note = document.createElement("div");
    note.className = "evidence-note";
    note.textContent = "Point at a sentence of the answer to see its sources in the context.";
    const field = result.evidence.flatMap((s) => s.sources.map((x) => x.field))[0] || "context";
    const text = field === "prompt" ? item.prompt
      : item.contexts ? item.contexts.join("\n\n") : item.context !== undefined ? item.context : item.prompt;
    card.append(note, sourcesBox(text, result.evidence));
    linkSources(card, result.evidence);
  }
  $("results").appendChild(card);
}

async function score(items) {
  $("status").textContent = "Scoring " + items.length + (items.length === 1 ? " answer" : " answers") + "...";
  $("status").className = "";
  $("results").replaceChildren();
  const detector = $("detector").value;
  const evidence = $("evidence").checked ? { evidence: "attention" } : {};
  const body = items.map((it) => ({ ...(detector && !it.detector ? { ...it, detector } : it), ...evidence }));
  const r = await fetch("/v1/score", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const data = await r.json();
  if (!r.ok) {
    $("status").textContent = "Error " + r.status + ": " + (data.error ? data.error.message : r.statusText);
    $("status").className = "error";
    return;
  }
  $("status").textContent = "";
  data.forEach((result, i) => show(result, items[i]));
}

$("one").addEventListener("submit", (e) => {
  e.preventDefault();
  score([{ id: "1", context: $("context").value, question: $("question").value, response: $("answer").value }]);
});

$("many").addEventListener("submit", async (e) => {
  e.preventDefault();
  const file = $("file").files[0];
  if (!file) { $("status").textContent = "Choose a file first."; return; }
  const lines = (await file.text()).split("\n").filter((l) => l.trim());
  try {
    score(lines.map((l, i) => {
      const o = JSON.parse(l);
      const item = { id: o.id !== undefined ? String(o.id) : String(i + 1), response: o.response };
      for (const k of ["context", "contexts", "question", "prompt", "detector"]) if (o[k] !== undefined) item[k] = o[k];
      return item;
    }));
  } catch (err) {
    $("status").textContent = "Not a JSONL file: " + err.message;
    $("status").className = "error";
  }
});

$("key").addEventListener("change", loadDetectors);
loadDetectors();
