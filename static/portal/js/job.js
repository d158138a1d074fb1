// The job page: its state, reason, progress, queue place, co-location and
// history are the server-rendered fragment, fetched again whenever the job's
// group says the job changed or reported progress (or the queue changed, while
// it waits); its output grows from the job's log chunks; the charts of its GPUs extend from its metric updates. Without a
// socket it polls the fragment every few seconds while visible.
"use strict";
(function () {
  const gl = window.gpulab;
  const box = document.getElementById("job-live"); // replaced on refresh: read its data once
  const jobId = Number(box.dataset.job);
  const urls = { partial: box.dataset.partialUrl, series: box.dataset.seriesUrl };
  const live = new gl.Live();
  const WAITING = ["pending", "held"];
  const MAX_LOG_CHARS = 200000;

  const state = () => document.getElementById("job-state");
  const status = () => (state() ? state().dataset.status : "");

  // ------------------------------------------------------------ the fragment
  // Every announced change fetches it again at once; the latest request wins
  // (an older response that completes last is dropped: gl.latestWins).
  const draw = (html) => {
    const old = document.getElementById("job-log");
    const wasAtBottom = !old || old.scrollTop + old.clientHeight >= old.scrollHeight - 4;
    gl.putFragments(html, ["job-head", "job-live"]);
    const log = document.getElementById("job-log");
    if (log && wasAtBottom) log.scrollTop = log.scrollHeight;
    if (WAITING.includes(status())) live.subscribe("queue");
    else live.unsubscribe("queue");
    if (gpusKey() !== chartsFor) loadCharts();
  };
  const fetchLatest = gl.latestWins(() => gl.getFragment(urls.partial), draw);
  const refresh = () => fetchLatest().catch((err) => console.warn(err));
  const soon = gl.debounced(refresh, 300);

  // ------------------------------------------------------------ output
  const appendLog = (msg) => {
    const pre = document.getElementById("job-log");
    if (!pre) return;
    if (pre.dataset.spansNodes) {
      soon(); // rank headers: the server lays it out
      return;
    }
    const last = JSON.parse(pre.dataset.last || "{}");
    const stream = `${msg.attempt}:${msg.node}`;
    if (stream in last && msg.offset <= last[stream]) return; // a replay
    last[stream] = msg.offset;
    pre.dataset.last = JSON.stringify(last);
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.append(document.createTextNode(msg.data));
    if (pre.textContent.length > MAX_LOG_CHARS) {
      pre.textContent = pre.textContent.slice(-MAX_LOG_CHARS);
    }
    pre.hidden = false;
    const empty = document.getElementById("job-log-empty");
    if (empty) empty.remove();
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  };

  // ------------------------------------------------------------ charts
  const chartBox = document.getElementById("job-gpus");
  const gib = (v) => (v === null || v === undefined ? null : Math.round((v / 1024) * 100) / 100);
  let util = null;
  let mem = null;
  let chartsFor = null;
  let shared = false;
  const gpusKey = () => (state() ? state().dataset.gpus : "");

  const drawCharts = (s) => {
    if (!chartBox || !window.Plotly) return;
    chartBox.hidden = !s.gpus.length;
    if (!s.gpus.length) return;
    util = util || new gl.Chart(document.getElementById("chart-util"), { title: "Utilisation (%)", yTitle: "%", yRange: [0, 100] });
    mem = mem || new gl.Chart(document.getElementById("chart-mem"), { title: "Memory held (GiB)", yTitle: "GiB" });
    for (const c of [util, mem]) {
      c.setRange(s.window_s, 0);
      c.opts.startS = s.start; // a young job: from its start, not 15 empty minutes
    }
    shared = s.shared;
    util.reset(s.gpus.map((g) => ({ key: g.key, name: g.label, t: g.t, y: g.util })));
    // Its own memory; the GPU's too where it shares the GPU (else the same line).
    mem.reset(
      s.gpus.flatMap((g) => [
        { key: `${g.key}:own`, name: s.shared ? `${g.label} this job` : g.label, t: g.t, y: g.own.map(gib) },
        ...(s.shared ? [{ key: `${g.key}:gpu`, name: `${g.label} whole GPU`, t: g.t, y: g.mem.map(gib) }] : []),
      ]),
    );
    chartsFor = s.gpus.map((g) => g.key).join(",");
  };
  const loadCharts = async () => {
    chartsFor = gpusKey();
    const resp = await fetch(urls.series, { credentials: "same-origin" });
    if (resp.ok) drawCharts(await resp.json());
  };

  // ------------------------------------------------------------ live
  live.on("job.status", (msg) => {
    const badge = document.querySelector('[data-testid="job-status"]');
    if (badge) {
      badge.textContent = msg.status;
      badge.className = `badge st-${msg.status}`;
    }
    refresh();
  });
  live.on("queue.changed", () => {
    if (WAITING.includes(status())) soon();
  });
  live.on("job.log", appendLog);
  live.on("job.progress", soon); // the progress line (with its rate) is the server's
  live.on("job.metrics", (msg) => {
    const partners = state() ? state().dataset.partners : "";
    for (const g of msg.gpus) {
      const label = g.key;
      if (util) util.push(g.key, label, msg.at, g.util);
      if (mem) {
        mem.push(`${g.key}:own`, shared ? `${label} this job` : label, msg.at, gib(g.own_mib));
        if (shared) mem.push(`${g.key}:gpu`, `${label} whole GPU`, msg.at, gib(g.mem));
      }
      const others = g.jobs.filter((j) => j !== jobId).join(",");
      if (others !== partners) soon(); // someone joined or left its GPU
    }
    if (util) util.flush();
    if (mem) mem.flush();
  });
  live.on("subscribed", (group, first) => {
    if (group !== `job.${jobId}`) return;
    // Whatever changed between the page's render (or the connection's loss)
    // and this subscription: fetch it once.
    refresh();
    if (!first) loadCharts();
  });
  gl.onVisible(() => {
    if (util) util.flush();
    if (mem) mem.flush();
  });

  // No socket (blocked, or the server is away): poll while visible.
  setInterval(() => {
    if (!live.open && gl.visible() && !state().dataset.terminal) refresh();
  }, 5000);

  const pre = document.getElementById("job-log");
  if (pre) pre.scrollTop = pre.scrollHeight; // the latest output first

  const initial = document.getElementById("series");
  if (initial) drawCharts(JSON.parse(initial.textContent));
  else chartsFor = gpusKey();
  live.subscribe("job", jobId);
  if (WAITING.includes(status())) live.subscribe("queue");
  live.start();
  gl.page = { live, refresh };
})();
