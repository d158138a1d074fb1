// Shared by the live pages (cluster, nodes, node, GPU, job, queue): the dashboard
// websocket with its subscriptions kept across reconnects, the visibility
// helpers, the GPU tile renderer (the same markup as _gpu_tile.html) and the
// chart helper (Plotly.extendTraces on a bounded window).
//
// Everything data-driven is written with textContent / setAttribute: names,
// commands and log lines never go through innerHTML. The only innerHTML is
// server-rendered (escaped) fragments fetched from our own views.
"use strict";
(function () {
  const gl = (window.gpulab = window.gpulab || {});

  gl.viewer = {
    user: document.body.dataset.user || "",
    staff: document.body.dataset.staff === "1",
  };
  gl.visible = () => document.visibilityState === "visible";
  gl.onVisible = (fn) =>
    document.addEventListener("visibilitychange", () => {
      if (gl.visible()) fn();
    });

  // ------------------------------------------------------------ formatting
  gl.gib = (mib) => {
    if (mib === null || mib === undefined) return "\u2013";
    const g = mib / 1024;
    return g >= 100 || g === Math.floor(g) ? g.toFixed(0) : g.toFixed(1);
  };
  gl.mib = (mib) => {
    if (mib === null || mib === undefined) return "\u2013";
    return mib < 1024 ? `${mib} MiB` : `${(mib / 1024).toFixed(1)} GiB`;
  };
  // The server's `duration` filter: '1d 2h', '4h 30m', '90s'.
  gl.duration = (seconds) => {
    if (seconds === null || seconds === undefined) return "\u2013";
    let s = Math.max(0, Math.floor(seconds));
    if (s < 60) return `${s}s`;
    const d = Math.floor(s / 86400);
    s -= d * 86400;
    const h = Math.floor(s / 3600);
    s -= h * 3600;
    const m = Math.floor(s / 60);
    s -= m * 60;
    const parts = [[d, "d"], [h, "h"], [m, "m"]];
    if (!d && !h) parts.push([s, "s"]);
    return parts.filter(([n]) => n).map(([n, u]) => `${n}${u}`).join(" ") || "0s";
  };
  // Plotly reads trace names as its own little HTML (<b>, <a href>, <br>): a
  // job named "<b>x</b>" must show as typed, so names are entity-escaped.
  gl.plotlyText = (text) =>
    String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  gl.el = (tag, attrs, text) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  };

  // A server-rendered fragment of our own view (the same view, asked for its
  // fragment as htmx would): a promise of its HTML.
  gl.getFragment = async (url) => {
    const resp = await fetch(url, {
      headers: { "HX-Request": "true" },
      credentials: "same-origin",
    });
    if (!resp.ok) throw new Error(`${url}: ${resp.status}`);
    return resp.text();
  };

  // Several parts of a page from one fragment: each element of `html` with one
  // of `ids` replaces the page's element with that id.
  gl.putFragments = (html, ids) => {
    const tpl = document.createElement("template");
    tpl.innerHTML = html; // our own view's escaped HTML
    for (const id of ids) {
      const fresh = tpl.content.getElementById(id);
      const old = document.getElementById(id);
      if (fresh && old) old.replaceWith(fresh);
    }
  };

  // Replace a container's content with a fragment of our own view.
  gl.fetchFragment = async (url, container) => {
    container.innerHTML = await gl.getFragment(url);
    return container;
  };

  // A page part fetched again whenever a change is announced: the latest
  // request wins. Each call starts a fetch at once, so it sees every change
  // announced before it (a change announced while another fetch is in flight
  // is never folded into that one, which may predate it), and numbers it; a
  // response is drawn only if no later request's response was drawn already,
  // so overlapping fetches that complete out of order never leave an older
  // state on the page. `load()` is a promise of the part (e.g. getFragment),
  // `apply(part)` draws it. The call's promise says whether it was drawn.
  gl.latestWins = (load, apply) => {
    let asked = 0;
    let drawn = 0;
    return async () => {
      const mine = ++asked;
      const part = await load();
      if (mine < drawn) return false; // a later request's answer is shown
      drawn = mine;
      apply(part);
      return true;
    };
  };

  // Times relative to now ("12s ago", "ran 4m") count on in the browser.
  const tickAgo = () => {
    if (!gl.visible()) return;
    const now = Date.now() / 1000;
    for (const el of document.querySelectorAll("[data-ago]")) {
      el.textContent = gl.duration(now - Number(el.dataset.ago)) + (el.dataset.suffix || "");
    }
  };
  setInterval(tickAgo, 1000);

  // ------------------------------------------------------------ the socket
  const status = document.getElementById("live-status");
  const setStatus = (state, text) => {
    document.body.dataset.live = state;
    if (!status) return;
    status.hidden = false;
    status.className = `live-status ${state}`;
    status.textContent = text;
  };

  // One socket per page. `subscribe(kind, id)` is kept and sent again after a
  // reconnect; `on(type, fn)` for update types and for "subscribed"
  // (fn(group, first)), "error" (fn(message)). A closed socket reconnects after
  // a delay (1 s doubling to 30 s, with jitter) that starts again from 1 s
  // only once a connection stayed up STABLE_MS: a server that accepts and then
  // drops the connection (Redis away: the subscriptions fail) is retried ever
  // more slowly, not every second by every open tab.
  const STABLE_MS = 10000;
  class Live {
    constructor() {
      this.subs = [];
      this.handlers = {};
      this.ws = null;
      this.backoff = 1000;
      this.seen = new Set();
      this.openedAt = 0;
    }
    on(type, fn) {
      (this.handlers[type] = this.handlers[type] || []).push(fn);
      return this;
    }
    emit(type, ...args) {
      for (const fn of this.handlers[type] || []) {
        try {
          fn(...args);
        } catch (err) {
          console.error(err);
        }
      }
    }
    send(msg) {
      if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(msg));
    }
    subscribe(kind, id) {
      const msg = id === undefined ? { subscribe: kind } : { subscribe: kind, id };
      if (this.subs.some((s) => JSON.stringify(s) === JSON.stringify(msg))) return;
      this.subs.push(msg);
      this.send(msg);
    }
    unsubscribe(kind, id) {
      const msg = id === undefined ? { subscribe: kind } : { subscribe: kind, id };
      const before = this.subs.length;
      this.subs = this.subs.filter((s) => JSON.stringify(s) !== JSON.stringify(msg));
      if (this.subs.length === before) return;
      this.send(id === undefined ? { unsubscribe: kind } : { unsubscribe: kind, id });
    }
    get open() {
      return !!this.ws && this.ws.readyState === WebSocket.OPEN;
    }
    start() {
      const scheme = location.protocol === "https:" ? "wss://" : "ws://";
      const ws = new WebSocket(`${scheme}${location.host}/ws/dashboard/`);
      this.ws = ws;
      if (!this.openedAt) setStatus("connecting", "connecting\u2026");
      let opened = 0; // when this socket opened (0: it never did)
      ws.onopen = () => {
        opened = this.openedAt = Date.now();
        setStatus("open", "live");
        for (const s of this.subs) ws.send(JSON.stringify(s));
      };
      ws.onmessage = (ev) => {
        let msg;
        try {
          msg = JSON.parse(ev.data);
        } catch (err) {
          return;
        }
        if (msg.subscribed) {
          const first = !this.seen.has(msg.subscribed);
          this.seen.add(msg.subscribed);
          this.emit("subscribed", msg.subscribed, first);
        } else if (msg.error) {
          console.warn("live:", msg.error);
          this.emit("error", msg.error);
        } else if (msg.type) {
          this.emit(msg.type, msg);
        }
      };
      ws.onclose = (ev) => {
        if (this.ws !== ws) return; // not the page's socket any more
        this.ws = null;
        if (opened && Date.now() - opened >= STABLE_MS) this.backoff = 1000;
        if (ev.code === 4401) {
          setStatus("closed", "signed out");
          return;
        }
        setStatus("reconnecting", "reconnecting\u2026");
        this.emit("closed");
        const delay = this.backoff * (0.5 + Math.random());
        this.backoff = Math.min(30000, this.backoff * 2);
        setTimeout(() => this.start(), delay);
      };
    }
  }
  gl.Live = Live;

  // Run fn at most once per `ms`, the last call winning; while the tab is
  // hidden, once it is visible again.
  gl.debounced = (fn, ms) => {
    let timer = null;
    let dirty = false;
    const run = () => {
      timer = null;
      if (!gl.visible()) {
        dirty = true;
        return;
      }
      dirty = false;
      fn();
    };
    gl.onVisible(() => {
      if (dirty) run();
    });
    return () => {
      if (!timer) timer = setTimeout(run, ms);
    };
  };

  // ------------------------------------------------------------ GPU tiles
  const LOAD_BOUNDS = [10, 40, 70, 90];
  gl.loadBucket = (util) => {
    if (util === null || util === undefined) return -1;
    const i = LOAD_BOUNDS.findIndex((b) => util < b);
    return i === -1 ? LOAD_BOUNDS.length : i;
  };
  const field = (tile, name) => tile.querySelector(`[data-f="${name}"]`);

  // The readings of a tile (node updates carry only these).
  gl.tileReadings = (tile, r) => {
    const util = r.util === null || r.util === undefined ? null : Math.round(r.util);
    field(tile, "util").textContent = util === null ? "\u2013" : `${util}%`;
    const total = r.mem_total || Number(tile.dataset.memTotal) || 0;
    if (r.mem_total) tile.dataset.memTotal = r.mem_total;
    const pct = r.mem !== null && r.mem !== undefined && total ? Math.min(100, Math.round((r.mem * 100) / total)) : 0;
    field(tile, "membar").style.width = `${pct}%`;
    if (total) field(tile, "mem").textContent = `${gl.gib(r.mem)}/${gl.gib(total)} GiB`;
    field(tile, "temp").textContent = r.temp === null || r.temp === undefined ? "\u2013" : `${Math.round(r.temp)}\u00b0C`;
    field(tile, "power").textContent = r.power === null || r.power === undefined ? "\u2013" : `${Math.round(r.power)} W`;
    for (const cls of [...tile.classList]) if (cls.startsWith("load-")) tile.classList.remove(cls);
    tile.classList.add(`load-${gl.loadBucket(util)}`);
    if (r.at) tile.dataset.at = r.at;
    tile.dataset.appliedAt = Date.now() / 1000;
  };

  const holder = (j) => {
    const div = gl.el("div", { class: "holder", "data-testid": "gpu-job", "data-job": j.id });
    let title = `#${j.id} ${j.name} (${j.owner})`;
    if (j.used_mib !== null) {
      title += `: ${gl.mib(j.used_mib)} used`;
      if (j.declared_mib) title += ` of ${gl.mib(j.declared_mib)} declared`;
    } else if (j.declared_mib) {
      title += `: ${gl.mib(j.declared_mib)} declared`;
    }
    div.title = title;
    const line = gl.el("div", { class: "h-line" });
    if (gl.viewer.staff || j.owner === gl.viewer.user) {
      line.append(gl.el("a", { href: `/jobs/${j.id}/` }, `#${j.id}`));
    } else {
      line.append(gl.el("span", {}, `#${j.id}`));
    }
    line.append(" ", gl.el("span", { class: "h-name" }, j.name));
    const sub = gl.el("div", { class: "h-sub" });
    sub.append(gl.el("span", { class: "h-owner" }, j.owner));
    if (j.used_mib !== null || j.declared_mib) {
      const used = j.used_mib !== null ? gl.gib(j.used_mib) : "?";
      const declared = j.declared_mib ? `/${gl.gib(j.declared_mib)}` : "";
      sub.append(" ", gl.el("span", { class: "h-mem" }, `${used}${declared} GiB`));
    }
    div.append(line, sub);
    return div;
  };

  // A whole tile from a GpuLive entry (cluster state and deltas).
  gl.renderTile = (tile, g) => {
    const lost = g.reason.includes("lost");
    tile.className = `tile state-${g.state} load-${g.load}${lost ? " lost" : ""}${g.stale ? " stale" : ""}${g.foreign.length ? " has-foreign" : ""}`;
    tile.dataset.memTotal = g.mem_total;
    gl.tileReadings(tile, g);
    tile.classList.remove(`load-${gl.loadBucket(g.util)}`);
    tile.classList.add(`load-${g.load}`);
    field(tile, "shared").hidden = g.state !== "shared";
    const jobs = field(tile, "jobs");
    jobs.replaceChildren();
    if (g.jobs.length) {
      for (const j of g.jobs) jobs.append(holder(j));
    } else if (g.state !== "unavailable") {
      jobs.append(gl.el("span", { class: "t-free" }, "free"));
    }
    const reason = field(tile, "reason");
    reason.hidden = !g.reason;
    reason.textContent = g.reason;
    reason.className = `t-reason${lost ? " bad" : ""}`;
    const foreign = field(tile, "foreign");
    foreign.hidden = !g.foreign.length;
    const procs = g.foreign.map((f) => `pid ${f.pid}${f.mib !== null ? " (" + gl.mib(f.mib) + ")" : ""}`);
    // the same words as the foreign_summary filter
    const held = g.foreign.reduce((sum, f) => sum + (f.mib || 0), 0);
    const count = g.foreign.length > 1 ? `\u00d7${g.foreign.length} ` : "";
    const what = held ? gl.mib(held) : g.foreign.map((f) => `pid ${f.pid}`).join(", ");
    foreign.textContent = g.foreign.length ? `\u26a0 foreign: ${count}${what}` : "";
    foreign.title = "processes no gpulab job owns: " + procs.join(" "); // as the template
  };

  // ------------------------------------------------------------ charts
  // Ticks that say what changes over the span shown (ms).
  const tickFormat = (spanMs) =>
    spanMs > 2 * 86400e3 ? "%b %d" : spanMs < 600e3 ? "%H:%M:%S" : "%H:%M";

  // A time-series chart: `reset(traces)` draws the history; `push(key, name,
  // t, y)` adds a live point (into the range's bucket: raw points as they come,
  // else the bucket's mean when it closes); `flush()` draws the pending points
  // with extendTraces (a bounded window) and moves the x range, only while the
  // tab is visible.
  class Chart {
    constructor(div, opts) {
      this.div = div;
      this.opts = opts;
      this.keys = [];
      this.pending = new Map();
      this.acc = new Map();
      this.drawn = false;
    }
    setRange(spanS, bucketS) {
      this.opts.spanS = spanS;
      this.opts.bucketS = bucketS;
    }
    get maxPoints() {
      const { spanS, bucketS } = this.opts;
      return Math.ceil(spanS / (bucketS || 1)) + 200;
    }
    layout() {
      const now = Date.now();
      const from = Math.max(now - this.opts.spanS * 1000, (this.opts.startS || 0) * 1000);
      return {
        title: { text: this.opts.title, font: { size: 13 }, x: 0.01, xanchor: "left" },
        margin: { t: 30, r: 10, b: 30, l: 48 },
        height: this.opts.height || 220,
        showlegend: true,
        legend: { orientation: "h", y: -0.15, font: { size: 11 } },
        xaxis: {
          type: "date",
          range: [new Date(from), new Date(now)],
          tickformat: tickFormat(now - from),
        },
        yaxis: { title: { text: this.opts.yTitle }, rangemode: "tozero", range: this.opts.yRange, fixedrange: true },
        uirevision: "keep",
      };
    }
    reset(traces) {
      this.keys = traces.map((t) => t.key);
      this.pending.clear();
      this.acc.clear();
      const data = traces.map((t) => ({
        x: t.t.map((s) => new Date(s * 1000)),
        y: t.y,
        name: gl.plotlyText(t.name),
        type: "scatter",
        mode: "lines",
        line: { width: 1.5, shape: "linear" },
        connectgaps: false,
      }));
      const layout = this.layout();
      layout.showlegend = data.length > 1;
      Plotly.react(this.div, data, layout, { displaylogo: false, responsive: true });
      this.drawn = true;
    }
    push(key, name, t, y) {
      const bucket = this.opts.bucketS;
      if (!bucket) {
        this._queue(key, name, t, y);
        return;
      }
      const start = Math.floor(t / bucket) * bucket;
      const acc = this.acc.get(key);
      if (acc && acc.start !== start) {
        this._queue(key, name, acc.start, acc.n ? acc.sum / acc.n : null);
        this.acc.delete(key);
      }
      const cur = this.acc.get(key) || { start, sum: 0, n: 0 };
      if (y !== null && y !== undefined) {
        cur.sum += y;
        cur.n += 1;
      }
      this.acc.set(key, cur);
    }
    _queue(key, name, t, y) {
      const p = this.pending.get(key) || { name, x: [], y: [] };
      p.x.push(new Date(t * 1000));
      p.y.push(y);
      if (p.x.length > this.maxPoints) {
        p.x.shift();
        p.y.shift();
      }
      this.pending.set(key, p);
    }
    flush() {
      if (!this.drawn || !gl.visible()) return;
      if (this.pending.size) {
        const fresh = [...this.pending.keys()].filter((k) => !this.keys.includes(k));
        if (fresh.length) {
          Plotly.addTraces(
            this.div,
            fresh.map((k) => ({
              x: [],
              y: [],
              name: gl.plotlyText(this.pending.get(k).name),
              type: "scatter",
              mode: "lines",
              line: { width: 1.5 },
            })),
          );
          this.keys.push(...fresh);
          if (this.keys.length > 1) Plotly.relayout(this.div, { showlegend: true });
        }
        const keys = [...this.pending.keys()];
        Plotly.extendTraces(
          this.div,
          { x: keys.map((k) => this.pending.get(k).x), y: keys.map((k) => this.pending.get(k).y) },
          keys.map((k) => this.keys.indexOf(k)),
          this.maxPoints,
        );
        this.pending.clear();
      }
      const now = Date.now();
      const from = Math.max(now - this.opts.spanS * 1000, (this.opts.startS || 0) * 1000);
      Plotly.relayout(this.div, {
        "xaxis.range": [new Date(from), new Date(now)],
        "xaxis.tickformat": tickFormat(now - from),
      });
    }
  }
  gl.Chart = Chart;
  gl.bucketOf = (resolution) => ({ raw: 0, "1m": 60, "1h": 3600 })[resolution] || 0;
})();
