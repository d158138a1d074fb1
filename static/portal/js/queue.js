// The queue page: the server-rendered tables, fetched again when the `queue`
// group says the queue changed (at most once a second; while the tab is hidden,
// once it is shown again) and once subscribed (what changed since the render,
// or while the connection was down).
"use strict";
(function () {
  const gl = window.gpulab;
  const box = document.getElementById("queue");
  const live = new gl.Live();
  const refresh = gl.debounced(() => {
    // the page of the queue this tab shows (?page=N)
    gl.fetchFragment(box.dataset.partialUrl + location.search, box).catch((err) => console.warn(err));
  }, 200);
  live.on("queue.changed", refresh);
  // Subscribed (first time or after a reconnect): what changed meanwhile.
  live.on("subscribed", refresh);
  live.subscribe("queue");
  live.start();
  gl.page = { live, refresh };
})();
