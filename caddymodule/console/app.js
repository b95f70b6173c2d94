// sluice console: polls api/state every 2 s and renders it. Every string
// from the node goes into the page as text (textContent), never as HTML.
// URLs are relative, so the page works under any mount path.
"use strict";
(function () {
  var REFRESH_MS = 2000;
  var HISTORY = 31; // snapshots kept for "last minute" counts (2 s apart)
  var prevBytes = {}; // agent key -> {t, to, from}
  var history = []; // [{t, counts}] of refusal counters

  function $(id) { return document.getElementById(id); }

  // el makes an element with text (never parsed as HTML) and a class.
  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  function fmtBytes(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? String(Math.round(n)) : n.toFixed(1)) + " " + units[i];
  }

  function fmtDuration(s) {
    if (s <= 0) return "—";
    var d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
    if (d > 0) return d + "d " + h + "h";
    if (h > 0) return h + "h " + m + "m";
    if (m > 0) return m + "m " + (s % 60) + "s";
    return s + "s";
  }

  function fmtTime(iso) {
    var t = new Date(iso);
    return isNaN(t) ? String(iso) : t.toLocaleString();
  }

  function limitText(u) { return u.limit > 0 ? u.in_use + " / " + u.limit : u.in_use + " (no limit)"; }

  // table fills t with a header row and one row per item.
  function table(t, heads, rows) {
    clear(t);
    var thead = el("thead"), tr = el("tr");
    heads.forEach(function (h) { tr.appendChild(el("th", h[0], h[1])); });
    thead.appendChild(tr);
    var tbody = el("tbody"), frag = document.createDocumentFragment();
    rows.forEach(function (r) {
      var row = el("tr", null, r.cls);
      r.cells.forEach(function (c, i) {
        var td = el("td", null, heads[i][1]);
        td.setAttribute("data-label", heads[i][0]);
        if (c instanceof Node) td.appendChild(c); else td.textContent = c === undefined || c === null ? "" : String(c);
        row.appendChild(td);
      });
      frag.appendChild(row);
    });
    tbody.appendChild(frag);
    t.appendChild(thead);
    t.appendChild(tbody);
  }

  function tags(list, cls) {
    var span = el("span");
    list.forEach(function (s) { span.appendChild(el("span", s, "tag" + (cls ? " " + cls : ""))); });
    return span;
  }

  function renderNode(s) {
    var n = s.node;
    $("node-id").textContent = n.id;
    var ready = $("ready");
    ready.textContent = n.draining ? "draining" : n.ready ? "ready" : "not ready";
    ready.className = "badge " + (n.ready ? "ok" : "bad");
    ready.title = n.reason || "";
    var dl = $("node-facts"), serving = Date.parse(n.serving_since) > 0; // zero time: not serving yet
    clear(dl);
    [
      ["id", n.id], ["build", n.build || "(development build)"], ["caddy", n.caddy],
      ["uptime", serving ? (n.uptime_seconds > 0 ? fmtDuration(n.uptime_seconds) : "< 1s") : "—"],
      ["serving since", serving ? fmtTime(n.serving_since) : "—"],
      ["control listener", n.address ? n.listen + " (bound " + n.address + ")" : n.listen],
      ["TLS", n.tls ? "on" : "off"], ["readiness", n.ready ? "ready" : "not ready: " + (n.reason || "")]
    ].forEach(function (f) { dl.appendChild(el("dt", f[0])); dl.appendChild(el("dd", f[1])); });
  }

  function renderLimits(s) {
    var l = s.limits, box = $("limit-bars");
    clear(box);
    [
      ["connections", l.max_connections, false], ["tunnel budget", l.tunnel_budget, true],
      ["pending streams", l.max_pending_streams, false], ["sessions", l.max_sessions, false]
    ].forEach(function (x) {
      var u = x[1], div = el("div", null, "limit"), label = el("div", null, "label");
      label.appendChild(el("span", x[0]));
      label.appendChild(el("span", x[2] ? fmtBytes(u.in_use) + (u.limit > 0 ? " / " + fmtBytes(u.limit) : "") : limitText(u), "muted"));
      var frac = u.limit > 0 ? Math.min(1, u.in_use / u.limit) : 0;
      var bar = el("div", null, "bar" + (frac >= 0.9 ? " hot" : "")), fill = el("span");
      fill.style.width = (frac * 100).toFixed(1) + "%";
      bar.appendChild(fill);
      div.appendChild(label);
      div.appendChild(bar);
      box.appendChild(div);
    });
    var extra = el("dl", null, "kv");
    [
      ["unauthenticated control conns", l.pending_connections],
      ["per address: conns / sessions / pending", [l.max_connections_per_address, l.max_sessions_per_address, l.max_pending_streams_per_address].map(function (v) { return v || "∞"; }).join(" / ")],
      ["tcp_port_range", l.tcp_port_range || "none"]
    ].forEach(function (f) { extra.appendChild(el("dt", f[0])); extra.appendChild(el("dd", f[1])); });
    box.appendChild(extra);
  }

  // rate is an agent's bytes per second each way since the last snapshot;
  // a total that fell (a connection ended) counts as none.
  function rate(a, now, seen) {
    var key = a.agent_id + "|" + a.connected_since, p = prevBytes[key];
    seen[key] = { t: now, to: a.bytes_to_clients, from: a.bytes_from_clients };
    if (!p || now <= p.t) return "—";
    var dt = (now - p.t) / 1000;
    var down = Math.max(0, a.bytes_to_clients - p.to) / dt, up = Math.max(0, a.bytes_from_clients - p.from) / dt;
    return "↓ " + fmtBytes(down) + "/s ↑ " + fmtBytes(up) + "/s";
  }

  function renderAgents(s) {
    var now = Date.parse(s.now), seen = {};
    $("agent-count").textContent = "(" + s.agents.length + ")";
    var rows = s.agents.map(function (a) {
      var lane = a.transport === "lane" ? "lane" : a.transport;
      if (a.direct_sockets) lane += " + direct";
      var id = el("span");
      id.appendChild(el("strong", a.agent_id));
      if (a.leaving) id.appendChild(el("span", "leaving", "tag leaving"));
      var names = a.routes.slice(0, 20).map(function (r) { return r.name; });
      if (a.routes.length > 20) names.push("+" + (a.routes.length - 20) + " more");
      return { cells: [id, a.build || "—", a.remote, fmtTime(a.connected_since), lane, tags(names), rate(a, now, seen), a.connections] };
    });
    prevBytes = seen;
    table($("agent-table"), [["agent"], ["build"], ["remote address"], ["connected since"], ["transport"], ["routes"], ["traffic", "num"], ["conns", "num"]], rows);
    if (rows.length === 0) { clear($("agent-table")); $("agent-table").appendChild(el("caption", "No agent connected.", "empty")); }
  }

  function renderRoutes(s) {
    var r = s.routes, box = $("route-tables"), total = 0;
    clear(box);
    var frag = document.createDocumentFragment();
    [
      ["HTTP hosts", r.hosts], ["Host patterns", r.patterns], ["Catch-all", r.catch_all],
      ["Named TCP services", r.tcp_names], ["SNI routes", r.sni], ["Listen-port routes", r.port_routes]
    ].forEach(function (x) {
      total += x[1].length;
      if (x[1].length === 0) return;
      frag.appendChild(el("h3", x[0] + " (" + x[1].length + ")"));
      var wrap = el("div", null, "scroll"), t = el("table");
      table(t, [["key", "key"], ["agent"], ["route"], ["kind"], ["standby"]], x[1].map(function (e) {
        return { cells: [e.key, e.agent, e.route, e.kind, e.others.join(", ")] };
      }));
      wrap.appendChild(t);
      frag.appendChild(wrap);
    });
    if (r.ports.length > 0) {
      total += r.ports.length;
      frag.appendChild(el("h3", "Claimed ports (" + r.ports.length + ")"));
      var wrap = el("div", null, "scroll"), t = el("table");
      table(t, [["port", "num"], ["address"], ["agent"], ["route"], ["standby"]], r.ports.map(function (p) {
        return { cells: [p.port, p.address, p.owner, p.route, (p.standby || []).join(", ")] };
      }));
      wrap.appendChild(t);
      frag.appendChild(wrap);
    }
    if (total === 0) frag.appendChild(el("p", "No routes.", "empty"));
    box.appendChild(frag);
    $("route-count").textContent = "(" + total + ")";
  }

  function refusalCounts(s) {
    var out = {}, f = s.refusals;
    Object.keys(f.limits).forEach(function (k) { out["client: " + k] = f.limits[k]; });
    Object.keys(f.streams).forEach(function (k) { out["agent stream: " + k] = f.streams[k]; });
    Object.keys(f.routes_rejected).forEach(function (k) { out["route rejected: " + k] = f.routes_rejected[k]; });
    out["agent auth failures"] = f.auth_failures;
    return out;
  }

  function renderRefusals(s) {
    var counts = refusalCounts(s), now = Date.parse(s.now);
    history.push({ t: now, counts: counts });
    if (history.length > HISTORY) history.shift();
    var old = history[0].counts, keys = Object.keys(counts).sort();
    var some = keys.filter(function (k) { return counts[k] > 0; }).sort(function (a, b) { return counts[b] - counts[a]; });
    var none = keys.filter(function (k) { return counts[k] === 0; });
    table($("refusal-table"), [["reason"], ["last min", "num"], ["total", "num"]], some.map(function (k) {
      var recent = Math.max(0, counts[k] - (old[k] || 0));
      return { cells: [k, recent > 0 ? "+" + recent : "0", counts[k]] };
    }));
    if (some.length === 0) {
      clear($("refusal-table"));
      $("refusal-table").appendChild(el("caption", "Nothing refused since the node started.", "empty"));
    }
    var rest = $("refusal-none");
    clear(rest);
    if (none.length > 0) {
      rest.appendChild(el("summary", none.length + " reasons with no refusal"));
      rest.appendChild(tags(none));
    }
  }

  // render draws a whole snapshot and returns how long it took (ms).
  function render(s) {
    var t0 = performance.now();
    renderNode(s);
    renderLimits(s);
    renderAgents(s);
    renderRoutes(s);
    renderRefusals(s);
    $("updated").textContent = "updated " + new Date(s.now).toLocaleTimeString();
    var ms = performance.now() - t0;
    window.sluiceConsole.lastRenderMs = ms;
    return ms;
  }

  function showError(msg) {
    var e = $("error");
    e.textContent = msg;
    e.hidden = !msg;
  }

  function refresh() {
    fetch("api/state", { cache: "no-store", credentials: "same-origin" }).then(function (resp) {
      if (resp.status === 401 || resp.status === 403) throw new Error("Not authorized: sign in again.");
      if (!resp.ok) throw new Error("The node answered " + resp.status + ".");
      return resp.json();
    }).then(function (s) {
      render(s);
      window.sluiceConsole.renders++;
      showError("");
    }).catch(function (err) {
      showError(err && err.message ? err.message : "The node did not answer.");
    }).then(function () {
      setTimeout(refresh, REFRESH_MS);
    });
  }

  function lookupResult(l) {
    var box = $("find-result");
    clear(box);
    if (l.match === "none" || !l.agent) { box.appendChild(el("p", "No agent serves it now.", "empty")); return; }
    var dl = el("dl");
    [
      ["agent", l.agent], ["route", l.route ? l.route.name : ""], ["kind", l.route ? l.route.kind : ""], ["match", l.match],
      ["standby", l.others.map(function (o) { return o.agent; }).join(", ") || "none"]
    ].forEach(function (f) { dl.appendChild(el("dt", f[0])); dl.appendChild(el("dd", f[1])); });
    box.appendChild(dl);
  }

  function find(ev) {
    ev.preventDefault();
    var q = new URLSearchParams();
    q.set($("find-kind").value, $("find-value").value.trim());
    fetch("api/lookup?" + q.toString(), { cache: "no-store", credentials: "same-origin" }).then(function (resp) {
      return resp.json().then(function (body) {
        if (!resp.ok) throw new Error(body.error || "The node answered " + resp.status + ".");
        return body;
      });
    }).then(function (body) { lookupResult(body.lookup); }).catch(function (err) {
      var box = $("find-result");
      clear(box);
      box.appendChild(el("p", err.message, "error"));
    });
  }

  window.sluiceConsole = { render: render, lastRenderMs: 0, renders: 0 };
  document.addEventListener("DOMContentLoaded", function () {
    $("find-form").addEventListener("submit", find);
    $("find-kind").addEventListener("change", function () {
      $("find-value").placeholder = { host: "app.example.com", name: "redis", server_name: "db.example.com", port: "5432" }[this.value];
    });
    refresh();
  });
})();
