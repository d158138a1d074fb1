// The queue page: the server-rendered tables, fetched again (the latest request
// winning) when the `queue` group says the queue changed (at most once a second; while the tab is hidden,
// once it is shown again) and once subscribed (what changed since the render,
// or while the connection was down).
"use strict";
(function () {
  const gl = window.gpulab;
  const box = document.getElementById("queue");
  const live = new gl.Live();
  // The latest request wins: an older response completing last is dropped
  // (gl.latestWins), so overlapping fetches never leave an older queue shown.
  const fetchLatest = gl.latestWins(
    // the page of the queue this tab shows (?page=N)
    () => gl.getFragment(box.dataset.partialUrl + location.search),
    (html) => {
      box.innerHTML = html; // our own view's escaped HTML
    },
  );
  const refresh = gl.debounced(() => fetchLatest().catch((err) => console.warn(err)), 200);
  live.on("queue.changed", refresh);
  // Subscribed (first time or after a reconnect): what changed meanwhile.
  live.on("subscribed", refresh);
  live.subscribe("queue");
  live.start();
  gl.page = { live, refresh };
})();
