// halwatch web page: one answer or a JSONL file to /v1/score, results with the flagged spans highlighted.
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

// The answer as text nodes, with each flagged span in a <mark> whose title gives its confidence.
function highlighted(response, spans) {
  const box = document.createElement("div");
  box.className = "answer";
  const chars = Array.from(response); // offsets count Unicode code points
  let at = 0;
  for (const s of [...spans].sort((a, b) => a.start - b.start)) {
    if (s.start > at) box.appendChild(document.createTextNode(chars.slice(at, s.start).join("")));
    const mark = document.createElement("mark");
    mark.textContent = chars.slice(s.start, s.end).join("");
    mark.title = "confidence " + Number(s.confidence).toFixed(3);
    box.appendChild(mark);
    at = Math.max(at, s.end);
  }
  if (at < chars.length) box.appendChild(document.createTextNode(chars.slice(at).join("")));
  return box;
}

function show(result, response) {
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
  card.append(head, meta, highlighted(response, result.spans));
  $("results").appendChild(card);
}

async function score(items) {
  $("status").textContent = "Scoring " + items.length + (items.length === 1 ? " answer" : " answers") + "...";
  $("status").className = "";
  $("results").replaceChildren();
  const detector = $("detector").value;
  const body = items.map((it) => (detector && !it.detector ? { ...it, detector } : it));
  const r = await fetch("/v1/score", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const data = await r.json();
  if (!r.ok) {
    $("status").textContent = "Error " + r.status + ": " + (data.error ? data.error.message : r.statusText);
    $("status").className = "error";
    return;
  }
  $("status").textContent = "";
  data.forEach((result, i) => show(result, items[i].response));
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
