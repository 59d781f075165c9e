// deltaserve's status page: polls /dashboard/data once a second and redraws.
// Written by hand, with no library: three small line charts drawn as inline SVG need no
// vendored charting bundle, and the page must work on a server with no internet access.
"use strict";

const POLL_MS = 1000;
const WINDOW_S = 300; // the charts' longest time span (the server keeps 5 minutes)
const MIN_SPAN_S = 60; // and their shortest, right after the server started
const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#3d7be0", "#e0823d", "#3da65a"];

function $(id) {
  return document.getElementById(id);
}

function formatBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function formatNumber(x, digits) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
}

function setText(id, text) {
  $(id).textContent = text;
}

function svgElement(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  if (text !== undefined) el.textContent = text;
  return el;
}

// One chart: `series` = [{name, points: [[t, y], ...], dots}], x = the last `span`
// seconds up to `now`, y from 0 to a rounded-up maximum, with a grid line at each round
// step (whole numbers only when `integers`, for row counts).
function drawChart(svg, series, now, span, integers = false) {
  const width = svg.clientWidth || 300;
  const height = svg.clientHeight || 160;
  const left = 40, right = 8, top = 8, bottom = 18;
  const plotW = width - left - right, plotH = height - top - bottom;
  let yMax = 0;
  for (const s of series) for (const [, y] of s.points) yMax = Math.max(yMax, y);
  yMax = niceCeiling(yMax);
  const mantissa = Math.round(yMax / 10 ** Math.floor(Math.log10(yMax)));
  let divisions = mantissa === 2 ? 4 : 5;
  if (integers && yMax < 5) divisions = yMax;
  const x = (t) => left + plotW * (1 - (now - t) / span);
  const y = (v) => top + plotH * (1 - v / yMax);

  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  for (let i = 0; i <= divisions; i += 1) {
    const value = (yMax * i) / divisions;
    svg.append(svgElement("line", { class: "grid", x1: left, x2: width - right, y1: y(value), y2: y(value) }));
    const label = value >= 100 ? value.toFixed(0) : Number(value.toPrecision(2)).toString();
    svg.append(svgElement("text", { x: left - 4, y: y(value) + 3, "text-anchor": "end" }, label));
  }
  const tick = span > 120 ? 60 : 15;
  for (let ago = 0; ago <= span; ago += tick) {
    const label = ago === 0 ? "now" : tick === 60 ? `-${ago / 60}m` : `-${ago}s`;
    const anchor = ago === 0 ? "end" : ago + tick > span ? "start" : "middle";
    svg.append(svgElement("text", { x: x(now - ago), y: height - 4, "text-anchor": anchor }, label));
  }
  series.forEach((s, k) => {
    const color = COLORS[k % COLORS.length];
    const visible = s.points.filter(([t]) => now - t <= span);
    const coords = visible.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    svg.append(svgElement("polyline", { class: "line", points: coords, stroke: color }));
    if (s.dots) {
      for (const [t, v] of visible) svg.append(svgElement("circle", { cx: x(t), cy: y(v), r: 2.5, fill: color }));
    }
    if (series.length > 1) {
      svg.append(svgElement("text", { x: left + 6 + 70 * k, y: top + 10, fill: color, style: `fill:${color}` }, s.name));
    }
  });
}

// The smallest 1, 2 or 5 times a power of ten at or above `v` (1 when v is 0).
function niceCeiling(v) {
  if (!(v > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(v));
  for (const step of [1, 2, 5, 10]) if (step * power >= v) return step * power;
  return 10 * power;
}

function zip(times, values) {
  return times.map((t, i) => [t, values[i]]);
}

function fillKeyValues(tableId, entries) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(
    ...Object.entries(entries).map(([key, value]) => {
      const row = document.createElement("tr");
      for (const text of [key, value === null ? "auto / unset" : String(value)]) {
        const cell = document.createElement("td");
        cell.textContent = text;
        row.append(cell);
      }
      return row;
    }),
  );
}

function fillRequests(records) {
  const body = $("requests").tBodies[0];
  body.replaceChildren(
    ...records.map((r) => {
      const row = document.createElement("tr");
      const cells = [
        [new Date(r.finished_at * 1000).toLocaleTimeString(), false],
        [r.request_id, false],
        [r.route, false],
        [r.num_prompt, true],
        [r.num_cached, true],
        [r.num_output, true],
        [formatNumber(r.ttft_s, 3), true],
        [formatNumber(r.tokens_per_s, 1), true],
        [r.finish, false],
      ];
      for (const [text, isNumber] of cells) {
        const cell = document.createElement("td");
        cell.textContent = text;
        if (isNumber) cell.className = "num";
        row.append(cell);
      }
      return row;
    }),
  );
}

function render(data) {
  const engine = data.engine, cache = data.prefix_cache, history = data.history;
  setText("model", data.model);
  const badge = $("engine-state");
  badge.textContent = engine.alive ? "engine running" : "engine down";
  badge.className = `badge ${engine.alive ? "ok" : "down"}`;
  setText("updated", `updated ${new Date(data.time * 1000).toLocaleTimeString()}`);

  setText("running", engine.running);
  setText("queued", engine.queued);
  setText("finished", data.totals.finished_requests);
  setText("generated", data.totals.generated_tokens);
  setText("prompt-tokens", data.totals.prompt_tokens);
  const recent = history.tokens_per_s.filter((_, i) => data.time - history.time[i] <= 10);
  const rate = recent.length ? recent.reduce((a, b) => a + b, 0) / recent.length : 0;
  setText("tokens-per-s", rate.toFixed(1));

  const budget = engine.state_bytes_budget;
  const used = engine.state_bytes_in_use;
  $("memory-bar").style.width = `${budget ? Math.min(100, (100 * used) / budget) : 0}%`;
  setText("memory", `${formatBytes(used)} of ${formatBytes(budget)} (MLX active ${formatBytes(engine.mlx_active_bytes)}, peak ${formatBytes(engine.mlx_peak_bytes)})`);
  if (cache.enabled) {
    const hitRate = cache.hit_rate === null ? null : 100 * cache.hit_rate;
    $("cache-bar").style.width = `${hitRate || 0}%`;
    setText("prefix-cache", `hit rate ${hitRate === null ? "-" : hitRate.toFixed(1) + " %"} ` +
      `(${cache.hit_tokens} of ${cache.lookup_tokens} tokens), ` +
      `${formatBytes(cache.bytes)} of ${formatBytes(cache.max_bytes)} held, ${cache.evictions} evictions`);
  } else {
    setText("prefix-cache", "off");
  }

  const steps = Object.entries(data.steps.kinds).filter(([, k]) => k.count > 0)
    .map(([kind, k]) => `${kind} ${k.count} x ${k.mean_ms.toFixed(1)} ms ` +
      `(host ${k.host_mean_ms.toFixed(1)} ms)`);
  setText("steps", (steps.length ? steps.join(", ") : "none yet") +
    (data.steps.traced ? `; ${data.steps.traced} traced a compiled shape` : ""));

  // From the oldest sample (the server's start) to now, between 1 and 5 minutes.
  const oldest = history.time.length ? history.time[0] : data.time;
  const span = Math.min(WINDOW_S, Math.max(MIN_SPAN_S, data.time - oldest));
  drawChart($("chart-throughput"), [{ name: "tokens/s", points: zip(history.time, history.tokens_per_s) }], data.time, span);
  drawChart($("chart-ttft"), [{ name: "TTFT", points: data.ttft.filter(([, v]) => v !== null), dots: true }], data.time, span);
  drawChart($("chart-rows"), [
    { name: "running", points: zip(history.time, history.running) },
    { name: "queued", points: zip(history.time, history.queued) },
  ], data.time, span, true);

  fillRequests(data.requests);
  fillKeyValues("platform", data.platform);
  fillKeyValues("settings", data.settings);
}

async function poll() {
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (err) {
    const badge = $("engine-state");
    badge.textContent = `no data (${err.message})`;
    badge.className = "badge down";
  }
  setTimeout(poll, POLL_MS);
}

poll();
