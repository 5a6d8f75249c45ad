// The iop status page: reads /status/events (one status document a second) and draws it.
// Every value from the edge reaches the page through textContent or an attribute set by DOM
// calls, never as markup; the Content-Security-Policy allows no inline script either.
"use strict";

(function () {
  const HISTORY = 300; // samples kept per pool for the sparklines: five minutes at one a second
  const KEY = "iop.key";
  const SVG = "http://www.w3.org/2000/svg";
  const MANY_PROVIDERS = 40; // above this, nodes start collapsed
  const keysRequired = document.querySelector('meta[name="iop-keys"]').content === "required";
  const ledgerOn = document.querySelector('meta[name="iop-ledger"]').content === "on";
  const RECENT = 50; // ledger rows kept in the recent requests table
  const USAGE_EVERY_MS = 60000; // the 24-hour usage is read again once a minute

  const $ = (id) => document.getElementById(id);
  const history = new Map(); // pool alias -> {waiting: number[], running: number[]}
  const poolViews = new Map();
  const nodeViews = new Map();
  const routeViews = new Map();
  let controller = null;
  let retryTimer = null;
  let backoffMs = 1000;
  let linkProblem = "";
  let lastStatus = null;
  let lastAt = null;
  let ledgerAbort = null;
  let usageTimer = null;
  let tailTimer = null;
  let recent = [];

  // --- small DOM helpers ------------------------------------------------------------------------

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function field(name, cls) {
    const node = el("span", cls || "value");
    node.dataset.field = name;
    return node;
  }

  function setText(node, text) {
    const s = String(text);
    if (node.textContent !== s) node.textContent = s;
  }

  function setBar(fill, used, total) {
    const ratio = total > 0 ? Math.min(1, used / total) : 0;
    fill.style.width = (ratio * 100).toFixed(1) + "%";
    fill.classList.toggle("full", total > 0 && used >= total);
  }

  function figure(label, name) {
    const box = el("div", "figure");
    const value = field(name);
    box.append(value, el("span", "label", label));
    return [box, value];
  }

  function fmtMs(ms) {
    if (ms === null || ms === undefined) return "–";
    if (ms < 1000) return Math.round(ms) + " ms";
    return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + " s";
  }

  function fmtDuration(s) {
    if (s < 60) return Math.floor(s) + "s";
    if (s < 3600) return Math.floor(s / 60) + "m";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  function fmtMb(mb) {
    return mb >= 1024 ? (mb / 1024).toFixed(mb >= 10240 ? 0 : 1) + " GB" : mb + " MB";
  }

  // --- the connection ---------------------------------------------------------------------------

  function start() {
    $("login").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY, key);
      $("key").value = "";
      connect();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      disconnect();
      askKey("");
    });
    $("filter").addEventListener("input", applyFilter);
    $("expand").addEventListener("click", () => setAllOpen(true));
    $("collapse").addEventListener("click", () => setAllOpen(false));
    if (keysRequired && !sessionStorage.getItem(KEY)) askKey("");
    else connect();
  }

  function disconnect() {
    if (controller) controller.abort();
    controller = null;
    if (retryTimer) clearTimeout(retryTimer);
    retryTimer = null;
    stopLedger();
  }

  function askKey(problem) {
    clearData();
    setLink("key needed", "idle");
    $("login").hidden = false;
    $("forget").hidden = true;
    setText($("login-error"), problem);
    $("key").focus();
  }

  async function connect() {
    disconnect();
    const key = sessionStorage.getItem(KEY);
    const headers = { Accept: "text/event-stream" };
    if (key) headers.Authorization = "Bearer " + key;
    const mine = new AbortController();
    controller = mine;
    setLink("connecting", "idle");
    let response;
    try {
      response = await fetch("status/events", { headers, cache: "no-store", signal: mine.signal });
    } catch (err) {
      if (!mine.signal.aborted) lost("cannot reach the edge");
      return;
    }
    if (response.status === 401) {
      sessionStorage.removeItem(KEY);
      askKey(key ? "The edge refused that key." : "");
      return;
    }
    if (!response.ok) {
      lost("the edge answered HTTP " + response.status);
      return;
    }
    $("login").hidden = true;
    $("forget").hidden = !key;
    startLedger(headers);
    try {
      await read(response.body);
    } catch (err) {
      // A dropped connection or an abort: handled below.
    }
    if (!mine.signal.aborted) {
      stopLedger();
      lost("the edge ended the live stream");
    }
  }

  async function read(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) {
          backoffMs = 1000;
          linkProblem = "";
          render(JSON.parse(data));
        }
      }
    }
  }

  function lost(reason) {
    const waitMs = backoffMs;
    backoffMs = Math.min(backoffMs * 2, 10000);
    linkProblem = "Lost the live view of the edge (" + reason + "); retrying in " + Math.round(waitMs / 1000) + " s.";
    if (lastAt) linkProblem += " The figures below are from " + lastAt.toLocaleTimeString() + ".";
    setLink("offline", "bad");
    document.body.classList.add("stale");
    drawBanners();
    retryTimer = setTimeout(connect, waitMs);
  }

  function setLink(text, state) {
    const link = $("link");
    setText(link, text);
    link.className = "pill " + state;
  }

  function clearData() {
    $("main").hidden = true;
    for (const id of ["pools", "routes", "nodes", "banners"]) $(id).replaceChildren();
    poolViews.clear();
    nodeViews.clear();
    routeViews.clear();
    history.clear();
    recent = [];
    $("recent").tBodies[0].replaceChildren();
    $("usage").replaceChildren();
    setText($("edge"), "");
    lastStatus = null;
    linkProblem = "";
  }

  // --- drawing ----------------------------------------------------------------------------------

  function render(st) {
    lastStatus = st;
    lastAt = new Date();
    document.body.classList.remove("stale");
    $("main").hidden = false;
    setLink("live", "ok");
    const e = st.edge;
    setText($("edge"), "edge " + e.id + " · iop " + e.version + " · up " + fmtDuration(e.uptime_s));
    drawBanners();
    drawPools(st.pools);
    drawRoutes(st.routes);
    drawNodes(st.nodes);
    applyFilter();
  }

  function drawBanners() {
    const items = [];
    if (linkProblem) items.push(["bad", linkProblem]);
    const st = lastStatus;
    if (st) {
      if (!st.edge.nats_connected) {
        items.push(["bad", "The edge has lost NATS: no request can be served until it reconnects."]);
      }
      for (const p of st.pools) {
        if (p.usable_capacity === 0) {
          let text = "Pool " + p.alias + " has no usable provider: " + p.connected_candidates + " of " +
            p.candidates.length + " candidates connected";
          if (p.connected_candidates > 0) text += ", every connected one out of rotation (breaker open)";
          if (p.waiting > 0) text += "; " + p.waiting + " requests waiting";
          if (p.retry_after_s) text += "; new requests are refused, retry after " + p.retry_after_s + " s";
          items.push(["bad", text + "."]);
        }
      }
      for (const r of st.routes) {
        if (!r.connected) items.push(["warn", "Direct route " + r.alias + ": node " + r.node + " is not connected."]);
      }
      for (const d of st.edge.drift || []) items.push(["info", "Running deployment differs from its file: " + d]);
    }
    const box = $("banners");
    const wanted = items.map(([, text]) => text).join("\n");
    if (box.dataset.shown === wanted) return;
    box.dataset.shown = wanted;
    box.replaceChildren(...items.map(([level, text]) => el("div", "banner " + level, text)));
  }

  function drawPools(pools) {
    const box = $("pools");
    const seen = new Set();
    for (const p of pools) {
      seen.add(p.alias);
      let view = poolViews.get(p.alias);
      if (!view) {
        view = makePool(p.alias);
        poolViews.set(p.alias, view);
      }
      box.append(view.root); // keeps the document's order; moving a node in place is cheap
      updatePool(view, p);
    }
    for (const [alias, view] of poolViews) {
      if (!seen.has(alias)) {
        view.root.remove();
        poolViews.delete(alias);
        history.delete(alias);
      }
    }
    $("no-pools").hidden = pools.length > 0;
  }

  function makePool(alias) {
    const root = el("article", "card pool");
    root.dataset.pool = alias;
    const head = el("div", "card-head");
    head.append(el("span", "name", alias), field("candidates", "muted"));
    const bar = el("div", "bar");
    const fill = el("div", "fill");
    bar.append(fill);
    const figs = el("div", "figures");
    const f = {};
    for (const [label, name] of [
      ["running", "running"],
      ["waiting", "waiting"],
      ["usable capacity", "usable_capacity"],
      ["queue wait p50", "queue_wait_p50_ms"],
      ["queue wait p95", "queue_wait_p95_ms"],
      ["peak running", "peak_running"],
    ]) {
      const [box, value] = figure(label, name);
      figs.append(box);
      f[name] = value;
    }
    const spark = document.createElementNS(SVG, "svg");
    spark.setAttribute("class", "spark");
    spark.setAttribute("viewBox", "0 0 " + HISTORY + " 40");
    spark.setAttribute("preserveAspectRatio", "none");
    spark.setAttribute("role", "img");
    spark.setAttribute("aria-label", "waiting and running over the last minutes");
    const running = document.createElementNS(SVG, "polyline");
    running.setAttribute("class", "running");
    const waiting = document.createElementNS(SVG, "polyline");
    waiting.setAttribute("class", "waiting");
    spark.append(running, waiting);
    const legend = el("div", "legend");
    legend.append(el("span", "key waiting", "waiting"), el("span", "key running", "running"),
      field("spark_max", "muted"));
    const tenants = el("div", "tenants");
    tenants.setAttribute("aria-label", "requests per tenant");
    root.append(head, bar, figs, spark, legend, tenants);
    return { root, fill, f, running, waiting, tenants, candidates: head.lastChild, sparkMax: legend.lastChild };
  }

  function updatePool(view, p) {
    setText(view.candidates, p.connected_candidates + "/" + p.candidates.length + " candidates connected");
    setText(view.f.running, p.running);
    setText(view.f.waiting, p.waiting);
    setText(view.f.usable_capacity, p.usable_capacity + " / " + p.total_capacity);
    setText(view.f.queue_wait_p50_ms, fmtMs(p.queue_wait_p50_ms));
    setText(view.f.queue_wait_p95_ms, fmtMs(p.queue_wait_p95_ms));
    setText(view.f.peak_running, p.peak_running);
    view.f.waiting.classList.toggle("hot", p.waiting > 0);
    view.root.classList.toggle("unusable", p.usable_capacity === 0);
    setBar(view.fill, p.running, p.usable_capacity);
    let h = history.get(p.alias);
    if (!h) {
      h = { waiting: [], running: [] };
      history.set(p.alias, h);
    }
    h.waiting.push(p.waiting);
    h.running.push(p.running);
    if (h.waiting.length > HISTORY) {
      h.waiting.shift();
      h.running.shift();
    }
    const top = Math.max(1, ...h.waiting, ...h.running);
    const points = (series) => {
      const offset = HISTORY - series.length;
      return series.map((v, i) => (offset + i) + "," + (38 - (v / top) * 36).toFixed(1)).join(" ");
    };
    drawTenants(view.tenants, p.tenants || []);
    view.waiting.setAttribute("points", points(h.waiting));
    view.running.setAttribute("points", points(h.running));
    setText(view.sparkMax, "last " + fmtDuration(h.waiting.length) + ", top " + top);
  }

  // One line per tenant with requests in the pool (the edge lists them most waiting first).
  function drawTenants(box, tenants) {
    const rows = tenants.map((t) => {
      const row = el("div", "tenant");
      row.dataset.tenant = t.tenant;
      const name = el("span", "name", t.tenant === "" ? "(no key)" : t.tenant);
      const prio = el("span", "muted", t.priority);
      const load = el("span", "value", t.waiting + " waiting · " + t.running + " running");
      load.dataset.field = "tenant_load";
      row.append(name, prio, load);
      row.classList.toggle("hot", t.waiting > 0);
      return row;
    });
    box.replaceChildren(...rows);
    box.hidden = rows.length === 0;
  }

  function drawRoutes(routes) {
    $("routes-section").hidden = routes.length === 0;
    const box = $("routes");
    const seen = new Set();
    for (const r of routes) {
      seen.add(r.alias);
      let view = routeViews.get(r.alias);
      if (!view) {
        const root = el("div", "route");
        root.dataset.route = r.alias;
        view = { root, dot: el("span", "dot"), name: el("span", "name", r.alias), target: field("target", "muted") };
        root.append(view.dot, view.name, el("span", "muted", "→"), view.target);
        routeViews.set(r.alias, view);
      }
      box.append(view.root);
      setText(view.target, r.node + " / " + r.resource + (r.connected ? "" : " (not connected)"));
      view.dot.className = "dot " + (r.connected ? "ok" : "bad");
    }
    for (const [alias, view] of routeViews) {
      if (!seen.has(alias)) {
        view.root.remove();
        routeViews.delete(alias);
      }
    }
  }

  function drawNodes(nodes) {
    const box = $("nodes");
    const total = nodes.reduce((n, node) => n + node.providers.length, 0);
    const connected = nodes.filter((n) => n.connected).length;
    setText($("node-count"), connected + " of " + nodes.length + " connected · " + total + " providers and CLI resources");
    const seen = new Set();
    for (const n of nodes) {
      seen.add(n.id);
      let view = nodeViews.get(n.id);
      if (!view) {
        view = makeNode(n.id, total <= MANY_PROVIDERS);
        nodeViews.set(n.id, view);
      }
      box.append(view.root);
      updateNode(view, n);
    }
    for (const [id, view] of nodeViews) {
      if (!seen.has(id)) {
        view.root.remove();
        nodeViews.delete(id);
      }
    }
  }

  function makeNode(id, open) {
    const root = el("details", "node");
    root.dataset.node = id;
    root.open = open;
    const summary = el("summary");
    const view = {
      root,
      dot: el("span", "dot"),
      state: field("state", "state"),
      load: field("load", "muted"),
      deviceShort: field("device", "muted device-short"),
      meta: el("div", "meta"),
      device: el("dl", "device"),
      list: el("div", "providers"),
      rows: new Map(),
      text: id.toLowerCase(),
    };
    summary.append(view.dot, el("span", "name", id), view.state, view.load, view.deviceShort);
    const head = el("div", "prov head");
    for (const h of ["provider", "adapter · model", "capacity", "in flight", "breaker", "served / failed", "serves", "qualification"]) {
      head.append(el("span", "", h));
    }
    view.list.append(head);
    root.append(summary, view.meta, view.device, view.list);
    return view;
  }

  function deviceSummary(d) {
    const parts = [];
    if (d.os || d.arch) parts.push([d.os, d.arch].filter(Boolean).join("/"));
    if (d.cpu_cores) parts.push(d.cpu_cores + " cores");
    if (d.memory_mb) parts.push(fmtMb(d.memory_mb));
    for (const a of d.accelerators || []) {
      parts.push(a.name + (a.memory_mb ? " " + fmtMb(a.memory_mb) : "") + (a.unified ? " (unified)" : ""));
    }
    return parts.join(" · ");
  }

  function deviceRows(d) {
    const rows = [];
    for (const [k, v] of Object.entries(d)) {
      if (v === "" || v === 0 || v === null) continue;
      let text;
      if (k === "memory_mb") text = fmtMb(v);
      else if (k === "accelerators" && v.length === 0) text = "none";
      else if (k === "accelerators") text = v.map((a) => a.name + (a.memory_mb ? " (" + fmtMb(a.memory_mb) + ")" : "")).join(", ");
      else text = typeof v === "object" ? JSON.stringify(v) : String(v);
      rows.push([k.replace(/_mb$/, "").replace(/_/g, " "), text]);
    }
    return rows;
  }

  function updateNode(view, n) {
    view.root.dataset.state = n.connected ? "connected" : "disconnected";
    view.dot.className = "dot " + (n.connected ? "ok" : "bad");
    let state = n.connected ? "connected" : "disconnected";
    if (!n.connected) state += n.last_seen_s_ago === null ? " (never seen)" : " (last seen " + fmtDuration(n.last_seen_s_ago) + " ago)";
    setText(view.state, state);
    let inFlight = 0, capacity = 0, cliRunning = 0, open = 0;
    for (const p of n.providers) {
      if (p.kind === "pool") {
        inFlight += p.in_flight;
        capacity += p.capacity || 0;
        if (p.breaker === "open") open += 1;
      } else cliRunning += p.in_flight;
    }
    let load = n.providers.length + (n.providers.length === 1 ? " entry" : " entries");
    if (capacity) load += " · " + inFlight + "/" + capacity + " in flight";
    if (n.providers.some((p) => p.kind === "cli")) load += " · CLI running " + cliRunning;
    if (open) load += " · " + open + " breaker open";
    setText(view.load, load);
    const meta = [];
    if (n.instance) meta.push("instance " + n.instance);
    if (n.version) meta.push("iop " + n.version);
    if (n.last_seen_s_ago !== null) meta.push("last heartbeat " + n.last_seen_s_ago.toFixed(1) + " s ago");
    if (n.legacy_concurrency !== null && n.legacy_concurrency !== undefined) {
      meta.push("legacy concurrency " + n.legacy_concurrency + " (not used for admission)");
    }
    setText(view.meta, meta.join(" · "));
    const device = n.device || null;
    setText(view.deviceShort, device ? deviceSummary(device) : "");
    const deviceKey = device ? JSON.stringify(device) : "";
    if (view.deviceKey !== deviceKey) {
      view.deviceKey = deviceKey;
      const items = [];
      for (const [k, v] of device ? deviceRows(device) : []) items.push(el("dt", "", k), el("dd", "", v));
      view.device.replaceChildren(...items);
      view.device.hidden = items.length === 0;
    }
    const seen = new Set();
    const words = [n.id];
    for (const p of n.providers) {
      seen.add(p.id);
      let row = view.rows.get(p.id);
      if (!row || row.kind !== p.kind) {
        if (row) row.root.remove();
        row = p.kind === "pool" ? makeProvider(p) : makeCli(p);
        view.rows.set(p.id, row);
      }
      view.list.append(row.root);
      if (p.kind === "pool") updateProvider(row, p, n.connected);
      else updateCli(row, p, n.connected);
      words.push(row.text);
    }
    for (const [id, row] of view.rows) {
      if (!seen.has(id)) {
        row.root.remove();
        view.rows.delete(id);
      }
    }
    view.text = words.join(" ").toLowerCase();
  }

  function makeProvider(p) {
    const root = el("div", "prov");
    root.dataset.provider = p.id;
    const bar = el("span", "bar");
    const fill = el("span", "fill");
    bar.append(fill);
    const inflight = el("span", "inflight");
    const count = field("in_flight");
    inflight.append(bar, count);
    const row = {
      kind: "pool",
      root,
      fill,
      count,
      kindText: field("adapter", "muted"),
      capacity: field("capacity"),
      breaker: field("breaker", "breaker"),
      counts: field("counts"),
      pools: field("pools", "muted"),
      verdict: field("verdict", "verdict"),
      text: "",
    };
    root.append(el("span", "pid", p.id), row.kindText, row.capacity, inflight, row.breaker, row.counts, row.pools, row.verdict);
    return row;
  }

  function updateProvider(row, p, connected) {
    // A model server the node runs itself: its state (cold starts and swaps wait through "starting").
    const server = p.server ? " · server " + (p.server.state || "stopped") : "";
    setText(row.kindText, p.type + (p.model ? " · " + p.model : "") + server);
    setText(row.capacity, p.capacity);
    setText(row.count, p.in_flight + "/" + p.capacity + (p.queued ? " +" + p.queued + " queued" : ""));
    setBar(row.fill, p.in_flight, p.capacity);
    let breaker = p.breaker.replace("_", "-");
    if (p.breaker === "open" && p.breaker_open_for_s) breaker += " " + Math.ceil(p.breaker_open_for_s) + "s";
    // Out of its pools (an operator, its lifecycle policy, a failed or an exclusive qualification).
    if (p.drained) breaker += " · drained (" + p.drained + ")";
    setText(row.breaker, breaker);
    row.breaker.className = "value breaker " + p.breaker;
    setText(row.counts, p.served + " / " + p.failed);
    setText(row.pools, p.pools.join(", "));
    setText(row.verdict, verdictText(p));
    row.root.classList.toggle("offline", !connected);
    row.text = [p.id, p.model || "", p.type, ...p.pools].join(" ");
  }

  // Qualification results (`iop qualify`, measured capacity) are shown when the edge reports them.
  function verdictText(p) {
    const parts = [];
    if (p.qualifying) parts.push("qualifying now (out of its pools)");
    else if (p.drained) parts.push("drained: " + p.drained);
    const q = p.qualification;
    if (q && typeof q === "object") {
      if (q.verdict) parts.push(q.verdict);
      if (q.recommended_capacity !== undefined && q.recommended_capacity !== null) {
        parts.push("recommended " + q.recommended_capacity);
      }
      const checks = (q.checks_passed || 0) + (q.checks_failed || 0);
      if (checks) parts.push(q.checks_passed + "/" + checks + " checks");
      if (q.date) parts.push(String(q.date).slice(0, 10));
    } else if (q) parts.push(String(q));
    return parts.join(" · ");
  }

  function makeCli(p) {
    const root = el("div", "prov cli");
    root.dataset.provider = p.id;
    const row = {
      kind: "cli",
      root,
      kindText: field("adapter", "muted"),
      running: field("in_flight"),
      counts: field("counts"),
      route: field("pools", "muted"),
      text: "",
    };
    root.append(el("span", "pid", p.id), row.kindText, field("capacity"), row.running, el("span", "breaker"),
      row.counts, row.route, el("span", "verdict"));
    setText(root.querySelector('[data-field="capacity"]'), "unlimited");
    return row;
  }

  function updateCli(row, p, connected) {
    setText(row.kindText, "cli" + (p.model ? " · " + p.model : ""));
    setText(row.running, p.in_flight + " running");
    setText(row.counts, p.served + " / " + p.failed);
    setText(row.route, p.route ? "route " + p.route : "no route");
    row.root.classList.toggle("offline", !connected);
    row.text = [p.id, p.model || "", "cli", p.route || ""].join(" ");
  }

  // --- the ledger: recent requests and usage per alias -----------------------------------------------

  function startLedger(headers) {
    $("ledger-off").hidden = ledgerOn;
    $("recent-wrap").hidden = !ledgerOn;
    $("usage-section").hidden = !ledgerOn;
    if (!ledgerOn) return;
    stopLedger();
    ledgerAbort = new AbortController();
    const signal = ledgerAbort.signal;
    const auth = headers.Authorization ? { Authorization: headers.Authorization } : {};
    followTail(auth, signal);
    loadUsage(auth, signal);
    usageTimer = setInterval(() => loadUsage(auth, signal), USAGE_EVERY_MS);
  }

  function stopLedger() {
    if (ledgerAbort) ledgerAbort.abort();
    ledgerAbort = null;
    if (usageTimer) clearInterval(usageTimer);
    usageTimer = null;
    if (tailTimer) clearTimeout(tailTimer);
    tailTimer = null;
  }

  // The ledger's records as they are written (newline-delimited JSON), starting a few minutes back.
  async function followTail(auth, signal) {
    try {
      const response = await fetch("usage/tail?since=5m", { headers: auth, cache: "no-store", signal });
      if (!response.ok) throw new Error("HTTP " + response.status);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        let added = false;
        while ((cut = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, cut).trim();
          buffer = buffer.slice(cut + 1);
          if (!line) continue;
          recent.unshift(JSON.parse(line));
          added = true;
        }
        if (added) {
          recent = recent.slice(0, RECENT);
          drawRecent();
        }
      }
    } catch (err) {
      // Stopped, or the edge went away: the status stream shows that; try again a little later.
    }
    if (!signal.aborted) tailTimer = setTimeout(() => followTail(auth, signal), 5000);
  }

  function drawRecent() {
    const rows = recent.map((r) => {
      const tr = el("tr");
      tr.dataset.request = r.id;
      const when = new Date(r.start * 1000).toLocaleTimeString();
      const where = r.provider ? (r.node ? r.node + " / " : "") + r.provider : "–";
      const tokens = r.input_tokens === null || r.input_tokens === undefined
        ? "–"
        : r.input_tokens + " / " + (r.output_tokens === null ? "–" : r.output_tokens);
      const status = String(r.status) + (r.error ? " " + r.error : "");
      for (const [text, cls] of [[when, ""], [r.alias || "–", "name"], [where, ""], [status, r.status >= 400 ? "bad" : "ok"],
        [fmtMs(r.duration_ms), "num"], [tokens, "num"]]) {
        tr.append(el("td", cls, text));
      }
      // The trace id to look up in the tracing backend; its first 8 digits shown, all of it on hover.
      const trace = el("td", "", r.trace_id ? r.trace_id.slice(0, 8) : "–");
      if (r.trace_id) trace.title = r.trace_id;
      tr.append(trace);
      return tr;
    });
    $("recent").tBodies[0].replaceChildren(...rows);
    $("recent-empty").hidden = rows.length > 0;
  }

  async function loadUsage(auth, signal) {
    let report;
    try {
      const response = await fetch("usage?since=24h&by=model,hour", { headers: auth, cache: "no-store", signal });
      if (!response.ok) throw new Error("HTTP " + response.status);
      report = await response.json();
    } catch (err) {
      return; // the next minute tries again
    }
    drawUsage(report.rows || []);
  }

  function drawUsage(rows) {
    const nowHour = Math.floor(Date.now() / 3600000);
    const byAlias = new Map();
    for (const r of rows) {
      const m = /^(\d{4})-(\d{2})-(\d{2})T(\d{2})$/.exec(String(r.hour));
      if (!m) continue;
      const hour = Date.UTC(+m[1], +m[2] - 1, +m[3], +m[4]) / 3600000;
      const slot = 23 - (nowHour - hour);
      if (slot < 0 || slot > 23) continue;
      const alias = r.model || "(no model)";
      let u = byAlias.get(alias);
      if (!u) {
        u = { requests: new Array(24).fill(0), tokens: new Array(24).fill(0), errors: 0, input: 0, output: 0, cached: 0 };
        byAlias.set(alias, u);
      }
      u.requests[slot] += r.requests;
      u.tokens[slot] += (r.input_tokens || 0) + (r.output_tokens || 0);
      u.errors += r.errors || 0;
      u.input += r.input_tokens || 0;
      u.output += r.output_tokens || 0;
      u.cached += r.cached_tokens || 0;
    }
    const cards = [];
    for (const alias of [...byAlias.keys()].sort()) cards.push(usageCard(alias, byAlias.get(alias)));
    $("usage").replaceChildren(...cards);
    setText($("usage-note"), byAlias.size ? "" : "(no request yet)");
  }

  function usageCard(alias, u) {
    const root = el("article", "card usage");
    root.dataset.usage = alias;
    const total = u.requests.reduce((a, b) => a + b, 0);
    const head = el("div", "card-head");
    const counted = (n, what) => n + " " + what + (n === 1 ? "" : "s");
    head.append(el("span", "name", alias), el("span", "muted", counted(total, "request") + " · " + counted(u.errors, "error")));
    const line = el("div", "muted");
    line.dataset.field = "tokens";
    // Token counts are what upstreams reported; a CLI resource reports none.
    line.textContent = u.input + u.output ? "tokens in " + u.input + " · out " + u.output : "no tokens reported";
    // The prefix-cache hit rate as the upstreams reported it: cached input tokens of all input tokens.
    if (u.input) line.textContent += " · cached " + Math.round((100 * u.cached) / u.input) + " %";
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "usage-chart");
    svg.setAttribute("viewBox", "0 0 240 60");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "requests (bars) and tokens (line) per hour, last 24 hours, for " + alias);
    const topRequests = Math.max(1, ...u.requests);
    const topTokens = Math.max(1, ...u.tokens);
    u.requests.forEach((n, i) => {
      const h = (n / topRequests) * 56;
      const bar = document.createElementNS(SVG, "rect");
      bar.setAttribute("class", "req");
      bar.setAttribute("x", String(i * 10 + 1));
      bar.setAttribute("width", "8");
      bar.setAttribute("y", (58 - h).toFixed(1));
      bar.setAttribute("height", h.toFixed(1));
      const title = document.createElementNS(SVG, "title");
      title.textContent = (23 - i) + " h ago: " + n + " requests, " + u.tokens[i] + " tokens";
      bar.append(title);
      svg.append(bar);
    });
    const tokens = document.createElementNS(SVG, "polyline");
    tokens.setAttribute("class", "tok");
    tokens.setAttribute("points", u.tokens.map((t, i) => (i * 10 + 5) + "," + (58 - (t / topTokens) * 56).toFixed(1)).join(" "));
    svg.append(tokens);
    const legend = el("div", "legend");
    legend.append(el("span", "key req", "requests / hour (top " + topRequests + ")"),
      el("span", "key tok", "tokens / hour (top " + topTokens + ")"));
    root.append(head, line, svg, legend);
    return root;
  }

  // --- many providers: a filter and collapsed nodes ----------------------------------------------

  function applyFilter() {
    const q = $("filter").value.trim().toLowerCase();
    for (const [id, view] of nodeViews) {
      if (!q) {
        view.root.hidden = false;
        for (const row of view.rows.values()) row.root.hidden = false;
        continue;
      }
      const nodeHit = id.toLowerCase().includes(q);
      let rowsHit = 0;
      for (const row of view.rows.values()) {
        const hit = nodeHit || row.text.toLowerCase().includes(q);
        row.root.hidden = !hit;
        if (hit) rowsHit += 1;
      }
      view.root.hidden = !nodeHit && rowsHit === 0;
      if (!nodeHit && rowsHit > 0) view.root.open = true;
    }
  }

  function setAllOpen(open) {
    for (const view of nodeViews.values()) if (!view.root.hidden) view.root.open = open;
  }

  start();
})();
