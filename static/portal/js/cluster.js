// The cluster and nodes pages: the server-rendered grid, kept live from the
// `cluster` group. A delta applies to state `base`; a page that holds another
// state (it missed one, or just connected) asks for the whole state again. A
// change of shape (a node or GPU came or went) fetches the grid fragment again.
// While the tab is hidden nothing is redrawn: the latest entries wait.
"use strict";
(function () {
  const gl = window.gpulab;
  const container = document.getElementById("cluster");
  const live = new gl.Live();
  let seq = null;
  const waiting = { gpus: new Map(), nodes: new Map(), headline: null };
  let refreshing = null;

  const gridShape = () => {
    const grid = container.querySelector("#node-grid");
    if (!grid) return null;
    return {
      order: grid.dataset.order,
      nodes: new Map([...grid.querySelectorAll("[data-node]")].map((n) => [n.dataset.node, n.dataset.gpus])),
    };
  };

  const refresh = () => {
    if (!refreshing) {
      refreshing = gl
        .fetchFragment(container.dataset.partialUrl, container)
        .catch((err) => console.warn(err))
        .finally(() => {
          refreshing = null;
        });
    }
    return refreshing;
  };

  const applyNode = (n) => {
    const section = container.querySelector(`[data-node="${n.id}"]`);
    if (!section || section.dataset.gpus !== n.gpus.join(",")) return false;
    const badge = section.querySelector('[data-f="status"]');
    badge.textContent = n.status_label;
    badge.className = `badge node-${n.status}`;
    const mode = section.querySelector('[data-f="mode"]');
    mode.hidden = !n.mode;
    mode.textContent = n.mode;
    section.className = `node status-${n.status}${n.mode ? " mode-" + n.mode : ""}`;
    return true;
  };

  const applyHeadline = (h) => {
    for (const [k, v] of Object.entries(h)) {
      const el = container.querySelector(`[data-h="${k}"]`);
      if (el && k !== "oldest_pending_at") el.textContent = v;
    }
    const starting = container.querySelector('[data-h="starting-text"]');
    if (starting) starting.hidden = !h.starting;
    const wait = container.querySelector('[data-h="wait"]');
    if (wait) wait.dataset.since = h.oldest_pending_at === null ? "" : h.oldest_pending_at;
    tickWait();
  };

  // Draw what waits; false if the grid's shape differs (then fetch it again).
  const draw = () => {
    if (!gl.visible()) return true;
    let ok = true;
    for (const n of waiting.nodes.values()) ok = applyNode(n) && ok;
    for (const g of waiting.gpus.values()) {
      const tile = container.querySelector(`[data-gpu="${g.key}"]`);
      if (tile) gl.renderTile(tile, g);
      else ok = false;
    }
    if (waiting.headline) applyHeadline(waiting.headline);
    waiting.nodes.clear();
    waiting.gpus.clear();
    waiting.headline = null;
    return ok;
  };

  const take = (nodes, gpus, headline) => {
    for (const n of nodes) waiting.nodes.set(n.id, n);
    for (const g of gpus) waiting.gpus.set(g.key, g);
    if (headline) waiting.headline = headline;
    if (!draw()) refresh();
  };

  const whole = (state) => {
    seq = state.seq;
    const shape = gridShape();
    const order = state.nodes.map((n) => n.id).join(",");
    const same =
      shape &&
      shape.order === order &&
      state.nodes.every((n) => shape.nodes.get(String(n.id)) === n.gpus.join(","));
    if (!same) {
      refresh().then(() => take(state.nodes, Object.values(state.gpus), state.headline));
      return;
    }
    take(state.nodes, Object.values(state.gpus), state.headline);
  };

  live.on("cluster.state", (msg) => whole(msg.state));
  live.on("cluster.delta", (d) => {
    if (d.base === 0) {
      whole({ seq: d.seq, nodes: d.nodes, gpus: Object.fromEntries(d.gpus.map((g) => [g.key, g])), headline: d.headline });
      return;
    }
    if (seq === null || d.base !== seq) {
      seq = null;
      live.send({ resync: "cluster" });
      return;
    }
    seq = d.seq;
    const shape = gridShape();
    if (d.removed_nodes.length || d.removed_gpus.length || (d.order && shape && d.order.join(",") !== shape.order)) {
      refresh();
      return;
    }
    take(d.nodes, d.gpus, d.headline);
  });
  live.on("subscribed", (group, first) => {
    // A reconnect: what was missed meanwhile comes with the whole state (the
    // server sends it after the ack) or, if none is recent, at the next delta.
    if (!first) seq = null;
  });

  // The longest wait counts up in the browser (no message needed).
  function tickWait() {
    const wait = container.querySelector('[data-h="wait"]');
    if (!wait || !gl.visible()) return;
    const since = wait.dataset.since;
    wait.textContent = since ? gl.duration(Date.now() / 1000 - Number(since)) : "\u2013";
  }
  setInterval(tickWait, 1000);
  gl.onVisible(() => {
    if (!draw()) refresh();
    tickWait();
  });

  live.subscribe("cluster");
  live.start();
  gl.page = { live, refresh };
})();
