// The node and GPU pages: the history charts (utilisation, memory, power,
// temperature, memory per job) for the chosen range, extended live from the
// node's group (one update a second), and the GPU tiles kept current. A
// reconnect or a range change fetches the series again.
"use strict";
(function () {
  const gl = window.gpulab;
  const script = document.getElementById("page-script");
  const nodeId = Number(script.dataset.node);
  const onlyIndex = script.dataset.gpuIndex === undefined ? null : Number(script.dataset.gpuIndex);
  const seriesUrl = script.dataset.seriesUrl;
  const grid = document.getElementById("cluster");
  let series = JSON.parse(document.getElementById("series").textContent);

  const gib = (v) => (v === null || v === undefined ? null : Math.round((v / 1024) * 100) / 100);
  const defs = [
    { id: "chart-util", title: "Utilisation (%)", yTitle: "%", yRange: [0, 100], col: "util" },
    { id: "chart-mem", title: "Memory used (GiB)", yTitle: "GiB", col: "mem", conv: gib },
    { id: "chart-power", title: "Power (W)", yTitle: "W", col: "power" },
    { id: "chart-temp", title: "Temperature (\u00b0C)", yTitle: "\u00b0C", col: "temp" },
  ];
  const charts = {};
  for (const d of defs) {
    charts[d.col] = new gl.Chart(document.getElementById(d.id), { title: d.title, yTitle: d.yTitle, yRange: d.yRange });
  }
  const procChart = new gl.Chart(document.getElementById("chart-procs"), {
    title: "Memory held per job (GiB)",
    yTitle: "GiB",
    height: 260,
  });
  const all = () => [...Object.values(charts), procChart];
  const procKey = (gpuKey, attempt, pid) => (attempt ? `${gpuKey}:a${attempt}` : `${gpuKey}:p${pid}`);
  const labels = new Map();

  const draw = (s) => {
    series = s;
    const bucket = gl.bucketOf(s.resolution);
    for (const c of all()) c.setRange(s.span_s, bucket);
    for (const d of defs) {
      charts[d.col].reset(
        s.gpus.map((g) => ({ key: g.key, name: g.label, t: g.t, y: d.conv ? g[d.col].map(d.conv) : g[d.col] })),
      );
    }
    labels.clear();
    procChart.reset(
      s.procs.map((p) => {
        const key = procKey(p.gpu, p.attempt, p.pid);
        labels.set(key, p.label);
        return { key, name: p.label, t: p.t, y: p.mib.map(gib) };
      }),
    );
    const note = document.getElementById("resolution");
    if (note) {
      const what = { raw: "every sample", "1m": "1-minute means", "1h": "1-hour means" }[s.resolution];
      note.textContent = `(${what}${s.range === "15m" ? ", then live each second" : ""})`;
    }
    for (const a of document.querySelectorAll(".ranges a")) {
      const active = a.dataset.range === s.range;
      a.classList.toggle("active", active);
      if (active) a.setAttribute("aria-current", "true");
      else a.removeAttribute("aria-current");
    }
  };

  const load = async (range) => {
    const resp = await fetch(`${seriesUrl}?range=${encodeURIComponent(range)}`, { credentials: "same-origin" });
    if (!resp.ok) return;
    draw(await resp.json());
  };

  for (const a of document.querySelectorAll(".ranges a")) {
    a.addEventListener("click", (ev) => {
      ev.preventDefault();
      const range = a.dataset.range;
      history.replaceState(null, "", `?range=${range}`);
      load(range);
    });
  }

  const live = new gl.Live();
  live.on("node.metrics", (msg) => {
    for (const g of msg.gpus) {
      if (onlyIndex !== null && g.index !== onlyIndex) continue;
      const key = `${nodeId}:${g.index}`;
      const name = `GPU ${g.index}`;
      charts.util.push(key, name, msg.at, g.util);
      charts.mem.push(key, name, msg.at, gib(g.mem));
      charts.power.push(key, name, msg.at, g.power);
      charts.temp.push(key, name, msg.at, g.temp);
      const held = new Map();
      for (const p of g.procs) {
        const k = procKey(key, p.attempt, p.pid);
        held.set(k, (held.get(k) || 0) + (p.mib || 0));
        if (!labels.has(k)) {
          let label = p.attempt ? (p.job ? `#${p.job}` : `attempt ${p.attempt}`) : `foreign pid ${p.pid}`;
          if (onlyIndex === null) label = `${name}: ${label}`;
          labels.set(k, label);
        }
      }
      for (const [k, mib] of held) procChart.push(k, labels.get(k), msg.at, gib(mib));
      const tile = grid.querySelector(`[data-gpu="${key}"]`);
      if (tile && gl.visible()) gl.tileReadings(tile, { ...g, at: msg.at });
    }
    for (const c of all()) c.flush();
  });
  live.on("node.state", (msg) => {
    for (const g of msg.gpus) {
      const tile = grid.querySelector(`[data-gpu="${g.key}"]`);
      if (tile) gl.renderTile(tile, g);
    }
    const section = grid.querySelector(`[data-node="${msg.node.id}"]`);
    if (section && onlyIndex === null && section.dataset.gpus !== msg.node.gpus.join(",")) {
      gl.fetchFragment(grid.dataset.partialUrl, grid);
    }
  });
  live.on("subscribed", (group, first) => {
    if (!first) load(series.range); // a reconnect: draw the whole range again
  });
  gl.onVisible(() => {
    for (const c of all()) c.flush();
  });

  draw(series);
  live.subscribe("node", nodeId);
  live.start();
  gl.page = { live, charts, procChart, load };
})();
