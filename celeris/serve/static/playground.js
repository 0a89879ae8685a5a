// Celeris playground: drives /v1/completions and /v1/chat/completions with stream_mode "denoise" and draws
// the answer canvas from each chunk's `celeris` object (tokens, token_steps, drafts, nfe, steps,
// tokens_per_forward). No framework, no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { cards: {}, controller: null, raceControllers: [] };

// ---- API ------------------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function readableError(status, error) {
  const code = error.code || error.type || "error";
  const param = error.param ? ` (parameter '${error.param}')` : "";
  return `${status ? status + " " : ""}${code}: ${error.message}${param}`;
}

async function responseError(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    if (body.error) return readableError(resp.status, body.error);
  } catch (_) { /* not JSON: show the text */ }
  return `HTTP ${resp.status}: ${text.slice(0, 300) || resp.statusText}`;
}

function showError(message) { const box = $("error"); box.textContent = message; box.hidden = false; }
function clearError() { $("error").hidden = true; $("error").textContent = ""; }

// POST `body` to `path` and call onChunk for every SSE chunk until [DONE]; throws Error(readable message).
async function streamRequest(path, body, signal, onChunk) {
  const resp = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!resp.ok) throw new Error(await responseError(resp));
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(readableError(0, chunk.error));
        onChunk(chunk);
      }
    }
  }
}

// ---- settings -------------------------------------------------------------------------------------

const FIELDS = ["max_tokens", "steps", "block_length", "decoding", "threshold", "temperature", "seed", "cache"];
const NUMERIC = new Set(["max_tokens", "steps", "block_length", "threshold", "temperature", "seed"]);

function mode() { return document.querySelector("input[name=mode]:checked").value; }

function settings() {
  const out = {};
  for (const name of FIELDS) {
    const raw = $(name).value.trim();
    if (raw === "") continue;
    if (name === "threshold" && $("decoding").value !== "threshold") continue;
    out[name] = NUMERIC.has(name) ? Number(raw) : raw;
  }
  return out;
}

// [path, body] of one request; `only` keeps just these settings (the race: each model its own defaults).
function buildRequest(model, prompt, stream, only) {
  let extra = settings();
  if (only) extra = Object.fromEntries(Object.entries(extra).filter(([k]) => only.includes(k)));
  const body = { model, ...extra };
  let path = "/v1/completions";
  if (mode() === "chat") {
    path = "/v1/chat/completions";
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: prompt });
    body.messages = messages;
  } else {
    body.prompt = prompt;
  }
  if (stream) Object.assign(body, { stream: true, stream_mode: "denoise", stream_options: { include_usage: true } });
  return [path, body];
}

function presetsFor(card) {
  const gen = (card && card.generation_config) || {};
  const presets = [{ name: "model defaults (generation_config.json)", values: {} }];
  if (card && card.decoding_kind === "diffusion") {
    presets.push({ name: "parallel: confidence threshold 0.9", values: { decoding: "threshold", threshold: 0.9 } });
    presets.push({ name: "one token per step", values: { steps: "", block_length: "" }, perToken: true });
  }
  if (card && card.decoding_kind === "hybrid") {
    presets.push({ name: "block diffusion (no verification)", values: { decoding: "fixed" } });
  }
  presets.push({ name: "sampled: temperature 0.8", values: { temperature: 0.8 } });
  return { gen, presets };
}

function applyPreset() {
  const card = state.cards[$("model").value];
  const { gen, presets } = presetsFor(card);
  const preset = presets[Number($("preset").value) || 0];
  for (const name of FIELDS) {
    if (name === "max_tokens" || name === "seed") continue;
    $(name).value = "";
  }
  const defaults = { steps: gen.steps, block_length: gen.block_length, temperature: gen.temperature,
                     decoding: gen.decoding || "fixed", cache: gen.cache, threshold: gen.threshold };
  for (const name of ["steps", "block_length", "temperature", "threshold"]) {
    $(name).placeholder = defaults[name] === undefined ? "default" : `${defaults[name]} (default)`;
  }
  $("decoding").options[0].textContent = `default (${defaults.decoding})`;
  $("cache").options[0].textContent = `default (${defaults.cache || "none"})`;
  for (const [name, value] of Object.entries(preset.values)) $(name).value = value;
  if (preset.perToken) $("steps").value = $("max_tokens").value;
}

function fillPresets() {
  const { presets } = presetsFor(state.cards[$("model").value]);
  $("preset").replaceChildren(...presets.map((p, i) => new Option(p.name, String(i))));
  applyPreset();
}

async function loadModels() {
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    showError(`could not reach the server: ${err.message}`);
    return;
  }
  if (!resp.ok) {
    showError(await responseError(resp));
    return;
  }
  clearError();
  const cards = (await resp.json()).data;
  state.cards = Object.fromEntries(cards.map((c) => [c.id, c]));
  const label = (c) => `${c.id} (${c.decoding_kind || "model"})`;
  for (const id of ["model", "race-a", "race-b"]) {
    const keep = $(id).value;
    $(id).replaceChildren(...cards.map((c) => new Option(label(c), c.id)));
    if (keep && state.cards[keep]) $(id).value = keep;
  }
  if (cards.length > 1 && $("race-a").value === $("race-b").value) $("race-b").value = cards[1].id;
  fillPresets();
}

// ---- the live view of one answer -------------------------------------------------------------------

const STAT_NAMES = [["step", "step"], ["nfe", "NFE"], ["tpf", "tokens / forward"], ["elapsed", "elapsed"],
                    ["ttft", "TTFT"], ["tps", "tokens / s"]];

function stepColour(step, last) {
  const t = last <= 1 ? 0 : (step - 1) / (last - 1);  // 0 = first step, 1 = the latest one
  return `hsl(${Math.round(210 - 210 * t)} 75% ${Math.round(70 - 8 * t)}%)`;
}

function showPiece(piece) {
  return piece.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/^ /, "\u00b7") || "\u2205";
}

// A new element; every string goes in as text (textContent), never as markup: model ids, card fields, answers
// and error messages come from the server and may carry HTML.
function element(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "text") node.textContent = value;
    else if (name === "className") node.className = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

class LiveView {
  constructor(root, prefix, title) {
    this.prefix = prefix;
    const stats = STAT_NAMES.map(([k, label]) =>
      element("div", {}, element("b", { id: `${prefix}-${k}`, text: "-" }), element("small", { text: label })));
    root.replaceChildren(
      ...(title ? [element("h4", { id: `${prefix}-title`, text: title })] : []),
      element("div", { className: "stats" }, ...stats),
      element("div", { id: `${prefix}-canvas`, className: "canvas", "aria-label": "answer canvas" }),
      element("div", { id: `${prefix}-drafts`, className: "hint" }),
      element("h3", { text: "Answer" }),
      element("pre", { id: `${prefix}-text`, className: "final" }),
      element("div", { id: `${prefix}-finish`, className: "finish" }));
    this.canvas = $(`${prefix}-canvas`);
  }

  set(key, text) { $(`${this.prefix}-${key}`).textContent = text; }

  start(numTokens) {
    this.t0 = performance.now();
    this.ttft = null;
    this.committed = 0;
    this.prevDrafts = null;
    this.acceptedDrafts = 0;
    this.checkedDrafts = 0;
    this.usage = null;
    this.finishReason = null;
    this.text = "";
    this.canvas.replaceChildren(...Array.from({ length: numTokens }, () => {
      const cell = document.createElement("span");
      cell.className = "cell masked";
      return cell;
    }));
    for (const [k] of STAT_NAMES) this.set(k, "-");
    this.set("step", "0");
    $(`${this.prefix}-text`).textContent = "";
    $(`${this.prefix}-finish`).textContent = "";
    $(`${this.prefix}-drafts`).textContent = "";
    clearInterval(this.timer);
    this.timer = setInterval(() => this.tick(), 100);
  }

  elapsed() { return (performance.now() - this.t0) / 1000; }

  tick() {
    const s = this.elapsed();
    this.set("elapsed", `${s.toFixed(2)} s`);
    if (this.committed) this.set("tps", (this.committed / s).toFixed(1));
  }

  onChunk(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return;
    const details = choice.celeris;
    if (details) {
      this.set("step", String(details.steps));
      this.set("nfe", String(details.nfe));
      this.set("tpf", details.tokens_per_forward.toFixed(2));
      if (details.tokens) this.draw(details);
    }
    const text = choice.text !== undefined ? choice.text : (choice.delta && choice.delta.content);
    if (!choice.finish_reason && text) $(`${this.prefix}-text`).textContent = text;  // the canvas, masks as \u2591
    if (choice.finish_reason) {
      this.finishReason = choice.finish_reason;
      this.text = choice.text !== undefined ? choice.text : (choice.delta && choice.delta.content) || "";
      $(`${this.prefix}-text`).textContent = this.text;
    }
  }

  draw(details) {
    const { tokens, token_steps: steps, drafts } = details;
    const last = Math.max(1, ...steps.filter((s) => s !== null));
    while (this.canvas.children.length < tokens.length) this.canvas.append(document.createElement("span"));
    let ended = false;
    let committed = 0;
    const firstMasked = tokens.indexOf(null);
    for (let i = 0; i < tokens.length; i++) {
      const cell = this.canvas.children[i];
      const piece = tokens[i];
      const wasAccepted = cell.classList.contains("accepted");
      if (piece === null) {
        cell.className = "cell masked";
        cell.style.backgroundColor = "";
        cell.textContent = "\u00a0";
        cell.title = `position ${i}: masked`;
        continue;
      }
      ended = ended || piece === "";
      if (!ended) committed++;
      cell.className = "cell committed" + (ended ? " end" : "") + (wasAccepted ? " accepted" : "");
      cell.textContent = showPiece(piece);
      cell.style.backgroundColor = stepColour(steps[i], last);
      cell.title = `position ${i}: ${JSON.stringify(piece)}, committed at step ${steps[i]}`;
    }
    // verified decoding: last pass's drafts that now hold the same token at their position were accepted
    if (this.prevDrafts) {
      const [start, prev] = this.prevDrafts;
      for (let j = 0; j < prev.length && start + j < tokens.length; j++) {
        if (tokens[start + j] === null) break;
        this.checkedDrafts++;
        if (tokens[start + j] !== prev[j]) break;
        this.acceptedDrafts++;
        this.canvas.children[start + j].classList.add("accepted");
      }
    }
    this.prevDrafts = null;
    if (drafts && drafts.length && firstMasked >= 0) {
      drafts.forEach((piece, j) => {
        const cell = this.canvas.children[firstMasked + j];
        if (!cell) return;
        cell.className = "cell draft";
        cell.style.backgroundColor = "";
        cell.textContent = showPiece(piece);
        cell.title = `position ${firstMasked + j}: draft ${JSON.stringify(piece)}, checked by the next pass`;
      });
      this.prevDrafts = [firstMasked, drafts];
    }
    if (this.checkedDrafts) {
      $(`${this.prefix}-drafts`).textContent =
        `verified decoding: ${this.acceptedDrafts} of ${this.checkedDrafts} drafts accepted so far`;
    }
    this.committed = committed;
    if (this.ttft === null && committed) {
      this.ttft = this.elapsed();
      this.set("ttft", `${(this.ttft * 1000).toFixed(0)} ms`);
    }
  }

  finish(outcome) {
    clearInterval(this.timer);
    const s = this.elapsed();
    this.set("elapsed", `${s.toFixed(2)} s`);
    const finish = $(`${this.prefix}-finish`);
    if (outcome) {
      finish.textContent = outcome;
      return;
    }
    const u = this.usage || {};
    if (u.completion_tokens !== undefined) this.set("tps", (u.completion_tokens / s).toFixed(1));
    finish.replaceChildren();
    const parts = [["finish_reason", this.finishReason], ["prompt_tokens", u.prompt_tokens],
                   ["completion_tokens", u.completion_tokens], ["total_tokens", u.total_tokens], ["nfe", u.nfe]];
    for (const [k, v] of parts) {
      const b = document.createElement("b");
      b.textContent = String(v);
      finish.append(`${k}: `, b, "  ");
    }
    finish.classList.add("done");
  }
}

function defaultMaxTokens(model) {
  const gen = (state.cards[model] && state.cards[model].generation_config) || {};
  return gen.max_tokens || gen.max_new_tokens || 64;  // the canvas grows if the answer is longer
}

// ---- generate -------------------------------------------------------------------------------------

let live;

function setRunning(running) {
  $("generate").disabled = running;
  $("stop").disabled = !running;
}

async function generate() {
  clearError();
  const [path, body] = buildRequest($("model").value, $("prompt").value, true);
  const numTokens = body.max_tokens || defaultMaxTokens(body.model);
  state.controller = new AbortController();
  setRunning(true);
  $("status").textContent = "generating";
  live.start(numTokens);
  try {
    await streamRequest(path, body, state.controller.signal, (chunk) => live.onChunk(chunk));
    live.finish();
    $("status").textContent = `done: ${live.finishReason}`;
  } catch (err) {
    if (err.name === "AbortError") {
      live.finish("stopped: the request was aborted");
      $("status").textContent = "stopped";
    } else {
      live.finish("failed");
      showError(err.message);
      $("status").textContent = "error";
    }
  } finally {
    setRunning(false);
    state.controller = null;
  }
}

// ---- race -----------------------------------------------------------------------------------------

const RACE_SETTINGS = ["max_tokens", "seed", "temperature"];

async function runLane(view, model, prompt, signal) {
  const [path, body] = buildRequest(model, prompt, true, RACE_SETTINGS);
  view.start(body.max_tokens || defaultMaxTokens(model));
  await streamRequest(path, body, signal, (chunk) => view.onChunk(chunk));
  view.finish();
  return view.usage ? view.usage.completion_tokens / view.elapsed() : 0;
}

async function aloneRate(model, prompt) {
  const [path, body] = buildRequest(model, prompt, false, RACE_SETTINGS);
  const t0 = performance.now();
  const resp = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!resp.ok) throw new Error(await responseError(resp));
  const out = await resp.json();
  return out.usage.completion_tokens / ((performance.now() - t0) / 1000);
}

async function race() {
  clearError();
  const prompt = $("race-prompt").value;
  const models = [$("race-a").value, $("race-b").value];
  const views = [new LiveView($("lane-a"), "race-a", models[0]), new LiveView($("lane-b"), "race-b", models[1])];
  const controller = new AbortController();
  state.raceControllers = [controller];
  $("race").disabled = true;
  $("race-stop").disabled = false;
  $("race-status").textContent = "racing";
  try {
    const rates = await Promise.all(models.map((m, i) => runLane(views[i], m, prompt, controller.signal)));
    $("race-status").textContent = "measuring each model alone";
    $("race-stop").disabled = true;
    for (let i = 0; i < 2; i++) {
      const alone = await aloneRate(models[i], prompt);
      const line = document.createElement("div");
      line.className = "done";
      line.id = `race-${"ab"[i]}-rates`;
      line.textContent = `tokens/s racing: ${rates[i].toFixed(1)} \u00b7 alone: ${alone.toFixed(1)}`;
      $(`race-${"ab"[i]}-finish`).append(line);
    }
    $("race-status").textContent = "done";
  } catch (err) {
    views.forEach((v) => clearInterval(v.timer));
    if (err.name === "AbortError") {
      $("race-status").textContent = "stopped";
    } else {
      showError(err.message);
      $("race-status").textContent = "error";
    }
  } finally {
    $("race").disabled = false;
    $("race-stop").disabled = true;
  }
}

// ---- view code ------------------------------------------------------------------------------------

function pyValue(value) {
  return JSON.stringify(value, null, 0).replace(/\btrue\b/g, "True").replace(/\bfalse\b/g, "False")
    .replace(/\bnull\b/g, "None");
}

function showCode() {
  const [path, body] = buildRequest($("model").value, $("prompt").value, false);
  const base = window.location.origin;
  const auth = $("api-key").value.trim() ? ` \\\n  -H "Authorization: Bearer $CELERIS_API_KEY"` : "";
  const json = JSON.stringify(body, null, 2).replace(/'/g, "'\\''");
  $("code-curl").textContent = `curl ${base}${path} \\\n  -H "Content-Type: application/json"${auth} \\\n  -d '${json}'`;
  const openaiNames = new Set(["model", "prompt", "messages", "max_tokens", "temperature", "seed"]);
  const args = Object.entries(body).filter(([k]) => openaiNames.has(k)).map(([k, v]) => `    ${k}=${pyValue(v)},`);
  const extra = Object.fromEntries(Object.entries(body).filter(([k]) => !openaiNames.has(k)));
  if (Object.keys(extra).length) args.push(`    extra_body=${pyValue(extra)},  # Celeris extensions`);
  const call = path.includes("chat") ? "chat.completions" : "completions";
  const read = path.includes("chat") ? "out.choices[0].message.content" : "out.choices[0].text";
  $("code-python").textContent = [
    "import os", "", "from openai import OpenAI", "",
    `client = OpenAI(base_url="${base}/v1", api_key=os.environ.get("CELERIS_API_KEY", "unused"))`,
    `out = client.${call}.create(`, ...args, ")", `print(${read})`,
    "print(out.choices[0].celeris)  # nfe, steps, tokens_per_forward, ... (Celeris extension)",
  ].join("\n");
  $("code-dialog").showModal();
}

// ---- wiring ---------------------------------------------------------------------------------------

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  $("view-generate").hidden = name !== "generate";
  $("view-race").hidden = name !== "race";
}

window.addEventListener("DOMContentLoaded", () => {
  live = new LiveView($("live"), "gen");
  $("api-key").value = sessionStorage.getItem("celeris-api-key") || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("celeris-api-key", $("api-key").value.trim());
    loadModels();
  });
  $("model").addEventListener("change", fillPresets);
  $("preset").addEventListener("change", applyPreset);
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", () => { $("system-row").hidden = mode() !== "chat"; });
  }
  $("generate").addEventListener("click", generate);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("race").addEventListener("click", race);
  $("race-stop").addEventListener("click", () => state.raceControllers.forEach((c) => c.abort()));
  $("view-code").addEventListener("click", showCode);
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showView(tab.dataset.view));
  loadModels();
});
