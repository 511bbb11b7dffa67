// pagedkv live dashboard: the block pool from /v1/kv, time series from /metrics,
// and the seeds' reservation-vs-paging experiment from /v1/simulate.
// Plain browser JavaScript, no build step and no external scripts.
"use strict";
(() => {
  const REFRESH_MS = 1000;
  const HISTORY = 300;             // samples kept for the charts (5 minutes at 1/s)
  const MAX_GRID_HEIGHT = 560;     // CSS px; cells shrink to keep big pools on screen
  const $ = (id) => document.getElementById(id);
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  const state = {
    key: sessionStorage.getItem("pagedkv-key") || "",
    snapshot: null,
    layout: null,          // {cell, gap, cols} of the last grid drawing
    highlight: null,       // request id whose blocks are outlined
    history: [],           // [{usage, util, running, waiting, swapped, hitNow, hitAll}]
    counters: null,        // last prefix counters, for the hit rate per interval
    frames: 0,
  };

  // ---------------------------------------------------------------- fetching
  class Unauthorized extends Error {}

  async function fetchOk(url) {
    const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
    const res = await fetch(url, { headers, cache: "no-store" });
    if (res.status === 401) throw new Unauthorized("API key required");
    if (!res.ok) {
      let message = `${res.status} ${res.statusText}`;
      try { message = (await res.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    return res;
  }

  /** Prometheus text -> Map(name -> value summed over label sets). */
  function parseMetrics(text) {
    const values = new Map();
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const m = /^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)/.exec(line);
      if (m) values.set(m[1], (values.get(m[1]) || 0) + Number(m[2]));
    }
    return values;
  }

  // ---------------------------------------------------------------- colours
  function hue(text) {
    let h = 2166136261;                       // FNV-1a: stable colour per request id
    for (let i = 0; i < text.length; i++) { h ^= text.charCodeAt(i); h = Math.imul(h, 16777619); }
    return ((h >>> 0) * 137.508) % 360;       // golden-angle spread
  }

  /** "cmpl-ab12-0#1" (request # sample) -> the request's hue, a lighter shade per sample. */
  function ownerColor(owner) {
    const [req, sample] = owner.split("#");
    const light = 42 + (Number(sample || 0) % 3) * 9;
    return `hsl(${hue(req).toFixed(0)} 62% ${light}%)`;
  }

  const requestOf = (owner) => owner.split("#")[0];

  // ---------------------------------------------------------------- the block grid
  function layoutFor(count, width) {
    let cell = 22;
    while (cell > 3 && Math.ceil(count / Math.max(1, Math.floor(width / cell))) * cell > MAX_GRID_HEIGHT) cell--;
    const cols = Math.max(1, Math.floor(width / cell));
    return { cell, cols, rows: Math.ceil(count / cols), gap: cell >= 10 ? 2 : 1 };
  }

  function drawBlock(ctx, b, x, y, s, blockSize, colors) {
    const used = b.state === "used";
    ctx.fillStyle = b.state === "cached" ? colors.cached : colors.free;
    ctx.fillRect(x, y, s, s);
    if (b.state === "cached" && s >= 6) {
      ctx.strokeStyle = colors.cachedEdge; ctx.lineWidth = 1;
      ctx.strokeRect(x + 0.5, y + 0.5, s - 1, s - 1);
    }
    if (!used) return;
    const owners = b.owners.length ? b.owners : ["?"];
    const h = Math.max(1, Math.round(s * Math.min(1, Math.max(b.fill, 1) / blockSize)));
    const w = s / owners.length;                 // a shared block: one slice per holder
    owners.forEach((o, i) => {
      ctx.fillStyle = o === "?" ? "#7d8596" : ownerColor(o);
      ctx.fillRect(x + i * w, y + s - h, Math.ceil(w), h);
    });
    if (b.ref_count > 1) {
      ctx.strokeStyle = colors.ink; ctx.lineWidth = s >= 10 ? 2 : 1;
      ctx.strokeRect(x + 1, y + 1, s - 2, s - 2);
      if (s >= 11) {
        ctx.font = `bold ${Math.floor(s * 0.6)}px system-ui, sans-serif`;
        ctx.textAlign = "center"; ctx.textBaseline = "middle";
        ctx.lineWidth = 3; ctx.strokeStyle = "rgba(0,0,0,.75)";
        ctx.strokeText(String(b.ref_count), x + s / 2, y + s / 2 + 1);
        ctx.fillStyle = "#fff";
        ctx.fillText(String(b.ref_count), x + s / 2, y + s / 2 + 1);
      }
    }
  }

  function drawGrid(snap) {
    const canvas = $("grid");
    const width = canvas.parentElement.clientWidth;
    const lay = layoutFor(snap.blocks.length, width);
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(lay.rows * lay.cell * dpr);
    canvas.style.height = `${lay.rows * lay.cell}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const colors = { free: css("--free"), cached: css("--cached"), cachedEdge: css("--cached-edge"), ink: "#1d2330" };
    const s = lay.cell - lay.gap;
    snap.blocks.forEach((b, i) => {
      const x = (i % lay.cols) * lay.cell, y = Math.floor(i / lay.cols) * lay.cell;
      drawBlock(ctx, b, x, y, s, snap.block_size, colors);
      if (state.highlight && b.owners.some((o) => requestOf(o) === state.highlight)) {
        ctx.strokeStyle = "#000"; ctx.lineWidth = 2; ctx.setLineDash([3, 2]);
        ctx.strokeRect(x + 0.5, y + 0.5, s - 1, s - 1); ctx.setLineDash([]);
      }
    });
    state.layout = lay;
    const count = (pred) => snap.blocks.filter(pred).length;
    const counts = {
      used: count((b) => b.state === "used"), shared: count((b) => b.ref_count > 1),
      cached: count((b) => b.state === "cached"), free: count((b) => b.state === "free"),
    };
    for (const [k, v] of Object.entries(counts)) { canvas.dataset[k] = v; $(`count-${k}`).textContent = v; }
    canvas.dataset.frame = ++state.frames;
  }

  function blockAt(evt) {
    const lay = state.layout, snap = state.snapshot;
    if (!lay || !snap) return null;
    const r = $("grid").getBoundingClientRect();
    const col = Math.floor((evt.clientX - r.left) / lay.cell), row = Math.floor((evt.clientY - r.top) / lay.cell);
    if (col < 0 || col >= lay.cols || row < 0) return null;
    return snap.blocks[row * lay.cols + col] || null;
  }

  function showTip(evt) {
    const tip = $("tip"), b = blockAt(evt);
    if (!b) { tip.hidden = true; return; }
    const lines = [`block ${b.id} · ${b.state}`, `fill ${b.fill}/${state.snapshot.block_size} tokens`];
    if (b.ref_count) lines.push(`ref count ${b.ref_count}`);
    if (b.owners.length) lines.push(`held by ${b.owners.join(", ")}`);
    tip.textContent = lines.join("\n");
    const r = $("grid-wrap").getBoundingClientRect();
    tip.style.left = `${evt.clientX - r.left + 12}px`;
    tip.style.top = `${evt.clientY - r.top + 12}px`;
    tip.hidden = false;
  }

  function renderRequests(snap) {
    const list = $("requests");
    const entries = Object.entries(snap.requests).sort(([a], [b]) => a.localeCompare(b));
    list.replaceChildren(...entries.map(([id, r]) => {
      const li = document.createElement("li");
      li.className = r.swapped ? "swapped" : "";
      const sw = document.createElement("i");
      sw.className = "sw"; sw.style.background = ownerColor(id);
      const cached = r.num_cached_tokens ? `, ${r.num_cached_tokens} cached` : "";
      li.append(sw, `${id.length > 22 ? "…" + id.slice(-20) : id}: ${r.block_table.length} blocks, ` +
                    `${r.num_tokens} tok${cached}${r.swapped ? " (swapped)" : ""}`);
      li.title = id;
      li.onmouseenter = () => { state.highlight = requestOf(id); drawGrid(snap); };
      li.onmouseleave = () => { state.highlight = null; drawGrid(snap); };
      return li;
    }));
    if (!entries.length) list.replaceChildren(Object.assign(document.createElement("li"), { textContent: "none" }));
  }

  // ---------------------------------------------------------------- charts (SVG)
  const SVG = "http://www.w3.org/2000/svg";
  const W = 600, H = 100, PAD = 24;

  function makeChart(el, title, series, { fraction }) {
    const head = document.createElement("div");
    head.className = "title";
    const name = document.createElement("span"), now = document.createElement("b");
    name.textContent = title;
    head.append(name, now);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "none");
    const axis = document.createElementNS(SVG, "path");
    axis.setAttribute("class", "axis");
    axis.setAttribute("d", `M${PAD} 4 V${H - 4} H${W}`);
    const top = document.createElementNS(SVG, "text");
    top.setAttribute("class", "tick"); top.setAttribute("x", 2); top.setAttribute("y", 12);
    svg.append(axis, top);
    const lines = series.map((s) => {
      const p = document.createElementNS(SVG, "polyline");
      p.setAttribute("stroke", s.color);
      svg.append(p);
      return p;
    });
    el.append(head, svg);
    const fmt = (v) => (v == null ? "—" : fraction ? `${(100 * v).toFixed(1)}%` : String(v));
    return (rows) => {
      const values = rows.map((r) => series.map((s) => r[s.key]));
      const max = fraction ? 1 : Math.max(1, ...values.flat().filter((v) => v != null)) * 1.15;
      top.textContent = fraction ? "100%" : String(Math.round(max));
      series.forEach((s, i) => {
        const pts = [];
        values.forEach((v, j) => {
          if (v[i] == null) return;
          const x = PAD + ((W - PAD) * (j + HISTORY - values.length)) / (HISTORY - 1);
          const y = H - 4 - ((H - 8) * v[i]) / max;
          pts.push(`${x.toFixed(1)},${y.toFixed(1)}`);
        });
        lines[i].setAttribute("points", pts.join(" "));
      });
      const last = rows[rows.length - 1] || {};
      now.textContent = series.map((s) => (series.length > 1 ? `${s.label} ` : "") + fmt(last[s.key])).join(" · ");
    };
  }

  const charts = [
    makeChart($("chart-usage"), "KV cache usage (blocks in use)", [{ key: "usage", color: "#e4572e" }], { fraction: true }),
    makeChart($("chart-util"), "Token utilization (real tokens / used slots)", [{ key: "util", color: "#2e9e6b" }], { fraction: true }),
    makeChart($("chart-reqs"), "Requests", [
      { key: "running", label: "running", color: "#3f88c5" },
      { key: "waiting", label: "waiting", color: "#f0a35e" },
      { key: "swapped", label: "swapped", color: "#7b5ea7" }], { fraction: false }),
    makeChart($("chart-hit"), "Prefix-cache hit rate", [
      { key: "hitNow", label: "last second", color: "#7b5ea7" },
      { key: "hitAll", label: "overall", color: "#1d2330" }], { fraction: true }),
  ];

  // ---------------------------------------------------------------- the live loop
  function pct(v) { return `${(100 * v).toFixed(1)}%`; }

  function sample(m) {
    const get = (name) => m.get(`pagedkv:${name}`) || 0;
    const hits = get("prefix_cache_hits_total"), queries = get("prefix_cache_queries_total");
    const prev = state.counters;
    const dq = prev ? queries - prev.queries : 0;
    state.counters = { hits, queries };
    return {
      usage: get("kv_cache_usage_perc"), util: get("kv_token_utilization"),
      running: get("num_requests_running"), waiting: get("num_requests_waiting"), swapped: get("num_requests_swapped"),
      hitNow: dq > 0 ? (hits - prev.hits) / dq : null, hitAll: queries ? hits / queries : null,
      capacity: get("kv_cache_capacity_tokens"), preemptions: get("num_preemptions_total"),
      drafted: get("spec_decode_num_draft_tokens_total"), accepted: get("spec_decode_num_accepted_tokens_total"),
    };
  }

  function renderCards(snap, row) {
    $("card-usage").textContent = pct(row.usage);
    $("card-blocks").textContent = `${snap.used} of ${snap.num_blocks} blocks used, ${snap.cached} cached`;
    $("card-util").textContent = pct(row.util);
    $("card-reqs").textContent = `${row.running} / ${row.waiting}`;
    $("card-reqs-sub").textContent = `running / waiting; ${row.swapped} swapped, ${row.preemptions} preemptions`;
    $("card-hit").textContent = row.hitAll == null ? "—" : pct(row.hitAll);
    $("card-hit-sub").textContent = `${snap.prefix_hits} of ${snap.prefix_queries} prompt tokens from cache`;
    $("card-spec-box").hidden = !row.drafted;     // only with --speculative-config
    $("card-spec").textContent = row.drafted ? pct(row.accepted / row.drafted) : "—";
    $("card-spec-sub").textContent = `${row.accepted} of ${row.drafted} draft tokens`;
    $("card-cap").textContent = `${row.capacity.toLocaleString()} tok`;
    $("card-cap-sub").textContent = `${snap.num_blocks} blocks × ${snap.block_size} tokens`;
    $("pool-summary").textContent = `${snap.num_blocks} blocks of ${snap.block_size} tokens · ` +
      `${snap.allocation_policy} · prefix caching ${snap.prefix_caching ? "on" : "off"}`;
  }

  function setStatus(text, cls) {
    const el = $("status");
    el.textContent = text; el.className = `status ${cls}`;
  }

  async function tick() {
    if (document.hidden) { setTimeout(tick, REFRESH_MS); return; }   // no polling from a background tab
    try {
      const [snap, text] = await Promise.all([
        fetchOk("v1/kv").then((r) => r.json()), fetchOk("metrics").then((r) => r.text())]);
      const row = sample(parseMetrics(text));
      state.history.push(row);
      if (state.history.length > HISTORY) state.history.shift();
      state.snapshot = snap;
      $("model").textContent = snap.model || "";
      drawGrid(snap);
      renderRequests(snap);
      renderCards(snap, row);
      charts.forEach((draw) => draw(state.history));
      setStatus(`live · ${new Date().toLocaleTimeString()}`, "ok");
    } catch (err) {
      if (err instanceof Unauthorized) $("key-form").hidden = false;
      setStatus(err.message || "disconnected", "bad");
    } finally {
      setTimeout(tick, REFRESH_MS);
    }
  }

  // ---------------------------------------------------------------- Play: reservation vs paging
  let playTimer = null;

  function playQuery() {
    const policy = document.querySelector("input[name=policy]:checked").value;
    const block = $("play-block").value || "16";
    const selected = policy === "paged" ? `paged:${block}` : policy;
    const params = new URLSearchParams({
      kv_memory: $("play-mem").value, bytes_per_token: $("play-bpt").value, max_model_len: $("play-mml").value,
      max_output: $("play-mo").value, requests: $("play-n").value, seed: $("play-seed").value,
      policies: ["reserve-max", "reserve-output", `paged:${block}`].join(","),
    });
    return { selected, url: `v1/simulate?${params}` };
  }

  function renderPlay(result, selected) {
    const pick = result.policies.find((p) => p.policy === selected);
    $("play-fit").textContent = pick.requests_fit.toLocaleString();
    $("play-util").textContent = pct(pick.token_utilization);
    const pool = Math.max(1, result.pool_tokens);
    const bar = $("play-bar");
    bar.querySelector(".real").style.width = `${(100 * pick.real_tokens) / pool}%`;
    bar.querySelector(".waste").style.width = `${(100 * (pick.reserved_tokens - pick.real_tokens)) / pool}%`;
    bar.title = `pool ${result.pool_tokens.toLocaleString()} token slots`;
    $("play-table").tBodies[0].replaceChildren(...result.policies.map((p) => {
      const tr = document.createElement("tr");
      if (p.policy === selected) tr.className = "selected";
      for (const v of [p.policy, p.requests_fit.toLocaleString(), p.real_tokens.toLocaleString(),
                       p.reserved_tokens.toLocaleString(), pct(p.token_utilization)]) {
        tr.append(Object.assign(document.createElement("td"), { textContent: v }));
      }
      return tr;
    }));
  }

  async function play() {
    const { selected, url } = playQuery();
    try {
      const result = await (await fetchOk(url)).json();
      $("play-error").hidden = true;
      renderPlay(result, selected);
    } catch (err) {
      if (err instanceof Unauthorized) $("key-form").hidden = false;
      $("play-error").textContent = err.message;
      $("play-error").hidden = false;
    }
  }

  // ---------------------------------------------------------------- wiring
  $("play-form").addEventListener("input", () => { clearTimeout(playTimer); playTimer = setTimeout(play, 200); });
  $("play-form").addEventListener("submit", (e) => e.preventDefault());
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("key").value;
    sessionStorage.setItem("pagedkv-key", state.key);
    $("key-form").hidden = true;
    play();
  });
  $("grid").addEventListener("mousemove", showTip);
  $("grid").addEventListener("mouseleave", () => { $("tip").hidden = true; });
  window.addEventListener("resize", () => state.snapshot && drawGrid(state.snapshot));

  window.pagedkv = { state, parseMetrics, layoutFor };   // for tests and the curious
  tick();
  play();
})();
