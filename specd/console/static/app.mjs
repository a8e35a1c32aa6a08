// specd's web console: Nodes, Models with live figures, a playground and apply.
// Plain ES modules over Preact + htm (vendored): no build step, nothing fetched but this daemon.
import { html, render, useState, useEffect, useRef } from "./vendor/htm-preact-standalone.mjs";

const API_KEY = "specd.apiKey";          // sessionStorage: gone with the tab, never shown
const ADMIN_TOKEN = "specd.adminToken";  // the admin API's bearer token, asked for only when it refuses
const ADMIN = "/apis/specd.dev/v1alpha1";
const POLL_MS = 2000;
const METHODS = ["none", "ngram", "draft", "eagle", "mtp", "dflash"];

class Refused extends Error {
  constructor(status, message, field) { super(message); this.status = status; this.field = field; }
}

function credentials(admin) {
  const token = admin ? sessionStorage.getItem(ADMIN_TOKEN) || sessionStorage.getItem(API_KEY)
                      : sessionStorage.getItem(API_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

// A JSON call to the daemon; a refusal raises Refused with the server's message and field.
async function call(path, { method = "GET", body, type = "application/json", admin = false } = {}) {
  const headers = credentials(admin);
  if (body !== undefined) headers["Content-Type"] = type;
  const r = await fetch(path, { method, headers, body: typeof body === "string" || body === undefined ? body : JSON.stringify(body) });
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = { message: text }; }
  if (!r.ok) {
    const err = data?.error ?? data ?? {};
    const field = err.param ?? data?.details?.causes?.[0]?.field ?? null;
    throw new Refused(r.status, err.message ?? `${r.status} ${r.statusText}`, field);
  }
  return data;
}

const gib = (n) => n == null ? "?" : `${(n / 2 ** 30).toFixed(n < 2 ** 30 ? 2 : 1)} GiB`;
const ready = (obj) => (obj.status?.conditions ?? []).find((c) => c.type === "Ready");

function Badge({ ok, children, warn }) {
  return html`<span class=${`badge ${ok ? "ok" : warn ? "warn" : "bad"}`}>${children}</span>`;
}

// ------------------------------------------------------------------ the key prompt

function KeyPrompt({ onKey, refused }) {
  const [value, setValue] = useState("");
  const submit = (e) => { e.preventDefault(); if (value) onKey(value); };
  return html`<main class="key-prompt card">
    <h1>specd console</h1>
    <p>This daemon asks for an API key, as its API does.</p>
    <form onSubmit=${submit}>
      <div class="row">
        <div class="field"><label for="field-api-key">API key</label><input id="field-api-key" type="password" autocomplete="off" value=${value}
          onInput=${(e) => setValue(e.target.value)} required /></div>
        <button class="primary" type="submit">Open the console</button>
      </div>
      ${refused && html`<p class="error" role="alert">That key was refused.</p>`}
    </form>
  </main>`;
}

// ------------------------------------------------------------------ Nodes

function MemoryBar({ status }) {
  const allocatable = status.allocatable || 0;
  if (status.requested == null) {
    return html`<p class="muted">Memory: allocatable ${gib(allocatable)}; use unknown while the Node is not Ready.</p>`;
  }
  const pct = (n) => `${Math.min(100, allocatable ? (100 * (n || 0)) / allocatable : 0).toFixed(1)}%`;
  const label = `memory: in use ${gib(status.inUse)}, requested ${gib(status.requested)}, allocatable ${gib(allocatable)}`;
  return html`<div>
    <div class="bar" role="img" aria-label=${label}>
      <div class="requested" style=${{ width: pct(status.requested) }}></div>
      <div class="in-use" style=${{ width: pct(status.inUse) }}></div>
    </div>
    <div class="legend memory">
      <span><i class="k-use"></i>in use ${gib(status.inUse)}</span>
      <span><i class="k-req"></i>requested ${gib(status.requested)}</span>
      <span><i class="k-free"></i>allocatable ${gib(allocatable)}</span>
      ${status.capacity ? html`<span>capacity ${gib(status.capacity)}</span>` : null}
    </div>
  </div>`;
}

function Topology({ nodes }) {
  const head = nodes.find((n) => n.spec.role === "head") ?? nodes[0];
  const others = nodes.filter((n) => n !== head);
  if (!head) return null;
  const width = Math.max(360, 160 * others.length + 40);
  const at = (i) => 20 + (i + 0.5) * ((width - 40) / Math.max(1, others.length));
  const up = (n) => ready(n)?.status === "True";
  const description = others.map((n) => `${head.metadata.name} to ${n.metadata.name}: ${up(n) ? "Ready" : "NotReady"}`).join("; ");
  return html`<svg class="topology" viewBox=${`0 0 ${width} ${others.length ? 170 : 60}`} role="img"
      aria-label=${`Links between Nodes. ${description || "One Node, no links."}`}>
    ${others.map((n, i) => html`<line x1=${width / 2} y1="40" x2=${at(i)} y2="130"
        class=${up(n) ? "link-ok" : "link-bad"} />`)}
    <rect x=${width / 2 - 60} y="10" width="120" height="30" rx="6" />
    <text x=${width / 2} y="30" text-anchor="middle">${head.metadata.name} (${head.spec.role})</text>
    ${others.map((n, i) => html`<g>
      <rect x=${at(i) - 60} y="130" width="120" height="30" rx="6" class=${up(n) ? "" : "down"} />
      <text x=${at(i)} y="150" text-anchor="middle">${n.metadata.name}${up(n) ? "" : " ✕"}</text></g>`)}
  </svg>`;
}

function NodeCard({ node }) {
  const c = ready(node) ?? {};
  const up = c.status === "True";
  const models = node.status.models ?? [];
  return html`<article class="card node" data-node=${node.metadata.name} aria-label=${`Node ${node.metadata.name}`}>
    <h3>${node.metadata.name}
      <${Badge} ok=${up}><span class="readiness">${up ? "Ready" : "NotReady"}</span></${Badge}>
      <span class="muted">${node.spec.role}</span></h3>
    <dl>
      <dt>Chip</dt><dd>${node.status.chip || "?"}</dd>
      <dt>Condition</dt><dd class="reason">${c.reason ?? "?"}</dd>
      <dt>Last seen</dt><dd class="last-seen">${c.message ?? "?"}</dd>
      ${node.spec.address && html`<dt>Address</dt><dd>${node.spec.address}</dd>`}
    </dl>
    <${MemoryBar} status=${node.status} />
    ${models.length > 0 && html`<ul class="plain node-models">${models.map((m) => html`<li>
${`${m.name}: ${m.phase}, requests ${gib(m.requested)}${m.inUse != null ? `, uses ${gib(m.inUse)}` : ""}`}</li>`)}</ul>`}
  </article>`;
}

function NodesView({ overview }) {
  const nodes = overview.nodes;
  const head = nodes.find((n) => n.spec.role === "head");
  return html`<section>
    <h2>Nodes</h2>
    <${Topology} nodes=${nodes} />
    ${head && html`<ul class="plain links" aria-label="Links">${nodes.filter((n) => n !== head).map((n) => html`
      <li data-link=${n.metadata.name}>${`${head.metadata.name} → ${n.metadata.name}: ${ready(n)?.status === "True" ? "Ready" : "NotReady"} (${ready(n)?.message ?? "never seen"}), TLS to ${n.spec.address}`}</li>`)}</ul>`}
    <div class="grid">${nodes.map((n) => html`<${NodeCard} key=${n.metadata.name} node=${n} />`)}</div>
  </section>`;
}

// ------------------------------------------------------------------ Models and their figures

const FIGURES = [
  ["tokens_per_second", "tokens/s", (v) => v.toFixed(1)],
  ["ttft_seconds", "time to first token", (v) => `${(v * 1000).toFixed(0)} ms`],
  ["running", "running", (v) => v.toFixed(0)],
  ["waiting", "waiting", (v) => v.toFixed(0)],
  ["acceptance_rate", "acceptance", (v) => `${(v * 100).toFixed(0)}%`],
  ["mean_accepted_length", "accepted per round", (v) => v.toFixed(2)],
  ["prefix_hit_rate", "prefix-cache hits", (v) => `${(v * 100).toFixed(0)}%`],
];

function Sparkline({ points, name, shown }) {
  const values = points.filter(([, v]) => v != null);
  const last = values.length ? values[values.length - 1][1] : null;
  let line = "";
  if (values.length > 1) {
    const t0 = points[0][0], t1 = points[points.length - 1][0] || t0 + 1;
    const top = Math.max(...values.map(([, v]) => v), 1e-9);
    line = values.map(([t, v]) => `${(100 * (t - t0) / (t1 - t0 || 1)).toFixed(1)},${(34 - 32 * v / top).toFixed(1)}`).join(" ");
  }
  const text = last == null ? "–" : shown(last);
  return html`<div class="chart" data-figure=${name}>
    <div class="name">${name}</div><div class="value">${text}</div>
    <svg viewBox="0 0 100 36" preserveAspectRatio="none" role="img" aria-label=${`${name} over the last minutes, now ${text}`}>
      ${line && html`<polyline points=${line} />`}</svg>
  </div>`;
}

function ModelCard({ entry, figures, node }) {
  const obj = entry.object, status = obj.status ?? {}, spec = obj.spec;
  const replicas = status.replicas ?? (status.phase ? [{ node, phase: status.phase }] : []);
  const requests = status.resources?.requests;
  const series = figures?.models?.[obj.metadata.name];
  return html`<article class="card model" data-model=${obj.metadata.name} aria-label=${`Model ${obj.metadata.name}`}>
    <h3>${obj.metadata.name} <${Badge} ok=${status.phase === "Ready"} warn=${status.phase === "Loading"}>
      <span class="phase">${status.phase ?? "Pending"}</span></${Badge}>
      <span class="muted">generation ${obj.metadata.generation}</span></h3>
    <dl>
      <dt>Source</dt><dd>${spec.source ?? spec.topologyRef ?? "?"}</dd>
      <dt>Replicas</dt><dd class="replicas">${replicas.length ? replicas.map((r, i) => html`${i ? ", " : ""}<span
        data-replica=${r.node}>${r.node} (${r.phase})</span>`) : "none placed"}</dd>
      <dt>Memory</dt><dd>${requests ? `requests ${gib(requests.memory)}` : "not requested yet"}${status.resources?.inUse != null ? `, uses ${gib(status.resources.inUse)}` : ""}</dd>
      <dt>Drafter</dt><dd>${entry.pairings.length ? entry.pairings.map((p) => `${p.metadata.name} (${p.spec.method})`).join(", ") : "none"}</dd>
      <dt>Policy</dt><dd>${entry.policies.length ? entry.policies.map((p) => `${p.metadata.name} (${p.spec.mode ?? "default"})`).join(", ") : "none"}</dd>
      ${status.speculation?.method && html`<dt>Speculating</dt><dd>${status.speculation.method}</dd>`}
    </dl>
    <h4>Conditions</h4>
    <ul class="plain conditions">${(status.conditions ?? []).map((c) => html`<li>
      <${Badge} ok=${(c.status === "True") !== (c.type === "Degraded")}>${c.type}</${Badge}> ${c.reason}: ${c.message}</li>`)}</ul>
    <h4>Live figures</h4>
    <div class="charts">${FIGURES.map(([key, name, shown]) => html`<${Sparkline} name=${name} shown=${shown}
      points=${series?.[key] ?? []} />`)}</div>
    <details><summary>Recent events (${entry.events.length})</summary>
      <ul class="plain events">${entry.events.slice().reverse().map((e) => html`<li>
        <span class="muted">${e.time}</span> ${e.type} ${e.reason}: ${e.message}</li>`)}</ul></details>
  </article>`;
}

function ModelsView({ overview, figures }) {
  return html`<section>
    <h2>Models</h2>
    ${overview.models.length === 0 && html`<p class="muted">No Models yet: apply one.</p>`}
    <div class="grid">${overview.models.map((m) => html`<${ModelCard} key=${m.object.metadata.name}
      entry=${m} figures=${figures} node=${overview.node} />`)}</div>
  </section>`;
}

// ------------------------------------------------------------------ Playground

// Read a server-sent event stream, calling onEvent with each data payload parsed as JSON.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") onEvent(JSON.parse(line.slice(6)));
      }
    }
  }
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function Playground({ overview }) {
  const models = overview.models.filter((m) => (m.object.spec.task ?? "generate") === "generate");
  const [model, setModel] = useState("");
  const [prompt, setPrompt] = useState("");
  const [temperature, setTemperature] = useState("0.7");
  const [maxTokens, setMaxTokens] = useState("128");
  const [method, setMethod] = useState("");
  const [k, setK] = useState("4");
  const [image, setImage] = useState(null);
  const [turns, setTurns] = useState([]);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState("");
  const [report, setReport] = useState(null);
  const fileInput = useRef(null);
  const chosen = models.find((m) => m.object.metadata.name === model) ?? models[0];
  const name = chosen?.object.metadata.name ?? "";
  const takesImages = (chosen?.object.status?.modalities ?? []).includes("image");

  async function send(e) {
    e.preventDefault();
    if (!prompt.trim() || busy) return;
    const content = image ? [{ type: "text", text: prompt }, { type: "image_url", image_url: { url: image } }] : prompt;
    const history = [...turns.map((t) => ({ role: t.role, content: t.content })), { role: "user", content }];
    const body = { model: name, messages: history, stream: true, stream_options: { include_usage: true },
                   temperature: Number(temperature), max_tokens: Number(maxTokens) };
    if (method) body.speculation = { method, ...(method !== "none" ? { num_speculative_tokens: Number(k) } : {}) };
    setTurns([...turns, { role: "user", content, shown: prompt, image }, { role: "assistant", content: "", chunks: 0 }]);
    setPrompt(""); setImage(null); setError(""); setReport(null); setBusy(true);
    if (fileInput.current) fileInput.current.value = "";
    try {
      const r = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
        headers: { "Content-Type": "application/json", ...credentials(false) } });
      if (!r.ok) {
        const data = await r.json().catch(() => ({}));
        throw new Refused(r.status, data.error?.message ?? `${r.status}`, data.error?.param);
      }
      await readEvents(r, (event) => {
        if (event.error) throw new Refused(500, event.error.message);
        const delta = event.choices?.[0]?.delta?.content;
        if (delta) {
          setTurns((all) => {
            const last = all[all.length - 1];
            return [...all.slice(0, -1), { ...last, content: last.content + delta, chunks: last.chunks + 1 }];
          });
        }
        if (event.usage) setReport(event.usage);
      });
    } catch (err) {
      setError(err.field ? `${err.field}: ${err.message}` : err.message);
    } finally {
      setBusy(false);
    }
  }

  if (!models.length) return html`<section><h2>Playground</h2><p class="muted">No Model to chat with: apply one.</p></section>`;
  const spec = report?.speculation;
  return html`<section>
    <h2>Playground</h2>
    <form onSubmit=${send}>
      <div class="row">
        <div class="field"><label for="field-model">Model</label><select id="field-model" value=${name} onChange=${(e) => { setModel(e.target.value); setTurns([]); setReport(null); }}>
          ${models.map((m) => html`<option value=${m.object.metadata.name}>${m.object.metadata.name}</option>`)}</select></div>
        <div class="field"><label for="field-temperature">Temperature</label><input id="field-temperature" type="number" min="0" max="2" step="0.1" value=${temperature}
          onInput=${(e) => setTemperature(e.target.value)} /></div>
        <div class="field"><label for="field-max-tokens">Max tokens</label><input id="field-max-tokens" type="number" min="1" max="4096" value=${maxTokens}
          onInput=${(e) => setMaxTokens(e.target.value)} /></div>
        <div class="field"><label for="field-speculation">Speculation</label><select id="field-speculation" value=${method} onChange=${(e) => setMethod(e.target.value)}>
          <option value="">the Model's own</option>
          ${METHODS.map((m) => html`<option value=${m}>${m}</option>`)}</select></div>
        ${method && method !== "none" && html`<div class="field"><label for="field-draft-tokens">Draft tokens</label><input id="field-draft-tokens" type="number" min="1" max="16" value=${k}
          onInput=${(e) => setK(e.target.value)} /></div>`}
        <button type="button" onClick=${() => { setTurns([]); setReport(null); setError(""); }}>New chat</button>
      </div>
      <div class="transcript" aria-live="polite" aria-label="Conversation">
        ${turns.length === 0 && html`<p class="muted">Replies stream here.</p>`}
        ${turns.map((t) => html`<div class=${`turn ${t.role}`} data-chunks=${t.chunks ?? ""}>
          <span class="who">${t.role === "user" ? "You" : name}</span>
          ${t.image && html`<img src=${t.image} alt="attached image" />`}<span class="text">${t.shown ?? t.content}</span></div>`)}
      </div>
      <div class="row">
        <div class="field grow"><label for="field-message">Message</label><textarea id="field-message" rows="3" value=${prompt} onInput=${(e) => setPrompt(e.target.value)}
          onKeyDown=${(e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e); }}></textarea></div>
      </div>
      <div class="row">
        ${takesImages && html`<div class="field"><label for="field-image">Image</label><input id="field-image" type="file" accept="image/*" ref=${fileInput}
          onChange=${async (e) => setImage(e.target.files[0] ? await readImage(e.target.files[0]) : null)} /></div>`}
        <button class="primary" type="submit" disabled=${busy}>${busy ? "Streaming…" : "Send"}</button>
      </div>
    </form>
    ${error && html`<p class="error" role="alert">${error}</p>`}
    ${report && html`<div class="card usage" aria-label="Usage">
      <h3>Usage</h3>
      <dl>
        <dt>Prompt tokens</dt><dd class="prompt-tokens">${report.prompt_tokens}</dd>
        <dt>Completion tokens</dt><dd class="completion-tokens">${report.completion_tokens}</dd>
        ${report.prompt_tokens_details?.cached_tokens != null && html`<dt>Cached</dt><dd>${report.prompt_tokens_details.cached_tokens}</dd>`}
        ${spec && html`<dt>Speculation</dt><dd class="speculation">${`${spec.method} (${spec.source}): ${spec.rounds} rounds, ${spec.accepted_tokens} of ${spec.draft_tokens} drafted tokens accepted (${(spec.acceptance_rate * 100).toFixed(0)}%), ${spec.mean_accepted_length} per round`}</dd>`}
      </dl></div>`}
  </section>`;
}

// ------------------------------------------------------------------ Apply

function Diff({ text, name }) {
  return html`<pre class="diff" tabindex="0" aria-label=${`what apply changes in ${name}`}>${text.replace(/\n$/, "").split("\n").map((line) => html`<span
    class=${line.startsWith("+") && !line.startsWith("+++") ? "add" : line.startsWith("-") && !line.startsWith("---") ? "del" : ""}>${`${line}\n`}</span>`)}</pre>`;
}

function ApplyView({ onApplied }) {
  const [yaml, setYaml] = useState("");
  const [result, setResult] = useState(null);
  const [error, setError] = useState(null);
  const [needsToken, setNeedsToken] = useState(false);
  const [token, setToken] = useState("");
  const [busy, setBusy] = useState(false);

  async function run(dryRun) {
    setBusy(true); setError(null); setResult(null);
    try {
      const out = await call(`${ADMIN}/apply${dryRun ? "?dryRun=All" : ""}`,
        { method: "POST", body: yaml, type: "application/yaml", admin: true });
      setResult({ dryRun, ...out });
      if (!dryRun) onApplied();
    } catch (err) {
      if (err.status === 401) setNeedsToken(true);
      setError(err);
    } finally {
      setBusy(false);
    }
  }
  const saveToken = (e) => { e.preventDefault(); sessionStorage.setItem(ADMIN_TOKEN, token); setToken(""); setNeedsToken(false); setError(null); };
  return html`<section>
    <h2>Apply</h2>
    ${needsToken && html`<form class="card" onSubmit=${saveToken}>
      <p>Changes go through the admin API, and it asks for its token.</p>
      <div class="row"><div class="field"><label for="field-admin-token">Admin token</label><input id="field-admin-token" type="password" autocomplete="off" value=${token}
        onInput=${(e) => setToken(e.target.value)} required /></div>
        <button class="primary" type="submit">Use this token</button></div></form>`}
    <div class="field grow"><label for="field-manifests-yaml">Manifests (YAML)</label><textarea id="field-manifests-yaml" rows="14" spellcheck="false" value=${yaml}
      onInput=${(e) => setYaml(e.target.value)}></textarea></div>
    <div class="row">
      <button type="button" onClick=${() => run(true)} disabled=${busy || !yaml.trim()}>Dry run and diff</button>
      <button class="primary" type="button" onClick=${() => run(false)} disabled=${busy || !yaml.trim()}>Apply</button>
    </div>
    ${error && html`<div class="error apply-error" role="alert">Refused (${error.status}): ${error.message}
      ${error.field && html`<div>Field: <code class="field-path">${error.field}</code></div>`}</div>`}
    ${result && html`<div class="card apply-result">
      <h3>${result.dryRun ? "Dry run: nothing stored" : "Applied"}</h3>
      ${result.warnings.map((w) => html`<p class="error">Warning: ${w}</p>`)}
      ${result.items.map((item) => html`<div>
        <p><strong>${item.kind}/${item.name}</strong>: <span class="action">${item.action}</span></p>
        ${item.diff ? html`<${Diff} text=${item.diff} name=${`${item.kind}/${item.name}`} />` : result.dryRun && html`<p class="muted">No change.</p>`}</div>`)}
    </div>`}
  </section>`;
}

// ------------------------------------------------------------------ the app

const TABS = [["nodes", "Nodes"], ["models", "Models"], ["playground", "Playground"], ["apply", "Apply"]];

function App() {
  const [state, setState] = useState("loading");  // loading | key | refused | open | down
  const [overview, setOverview] = useState(null);
  const [figures, setFigures] = useState(null);
  const [tab, setTab] = useState(location.hash.slice(1) || "nodes");
  const [problem, setProblem] = useState("");

  async function refresh() {
    try {
      const [o, f] = await Promise.all([call("/ui/api/overview"), call("/ui/api/figures")]);
      setOverview(o); setFigures(f); setState("open"); setProblem("");
    } catch (err) {
      if (err.status === 401) {
        setOverview(null); setFigures(null);
        setState(sessionStorage.getItem(API_KEY) ? "refused" : "key");
      } else {
        setProblem(`The daemon did not answer: ${err.message}`);
      }
    }
  }
  useEffect(() => {
    refresh();
    const timer = setInterval(() => { if (state === "open" || state === "loading") refresh(); }, POLL_MS);
    return () => clearInterval(timer);
  }, [state]);
  useEffect(() => { location.hash = tab; }, [tab]);

  if (state === "key" || state === "refused") {
    return html`<${KeyPrompt} refused=${state === "refused"}
      onKey=${(key) => { sessionStorage.setItem(API_KEY, key); setState("loading"); }} />`;
  }
  if (!overview) return html`<main><p>${problem || "Loading…"}</p></main>`;
  const forget = () => { sessionStorage.removeItem(API_KEY); sessionStorage.removeItem(ADMIN_TOKEN); setState("key"); };
  return html`<div>
    <header>
      <h1>specd</h1><span class="who">${overview.node} · ${overview.role} · ${overview.nodes.length} Node${overview.nodes.length === 1 ? "" : "s"}</span>
      <nav role="tablist" aria-label="Views">${TABS.map(([id, label]) => html`<button role="tab" id=${`tab-${id}`}
        aria-selected=${tab === id} aria-controls="view" onClick=${() => setTab(id)}>${label}</button>`)}</nav>
      <span class="spacer"></span>
      ${problem && html`<span class="error" role="status">${problem}</span>`}
      ${sessionStorage.getItem(API_KEY) && html`<button type="button" onClick=${forget}>Forget key</button>`}
    </header>
    <main><div id="view" role="tabpanel" aria-labelledby=${`tab-${tab}`}>
      ${tab === "nodes" && html`<${NodesView} overview=${overview} />`}
      ${tab === "models" && html`<${ModelsView} overview=${overview} figures=${figures} />`}
      ${tab === "playground" && html`<${Playground} overview=${overview} />`}
      ${tab === "apply" && html`<${ApplyView} onApplied=${refresh} />`}
    </div></main>
  </div>`;
}

render(html`<${App} />`, document.getElementById("app"));
