// exactlyonce console: refreshes the overview's figures every 5 seconds
// from the API. The page works without it: the figures are in the HTML.
(function () {
  "use strict";
  var prefix = document.body.getAttribute("data-prefix") || "";
  var table = document.getElementById("consumers");
  if (!table) { return; }

  function num(v) { return v === null || v === undefined ? "not counted" : String(v); }
  function duration(s) {
    if (s === null || s === undefined) { return "none pending"; }
    if (s < 10) { return s.toFixed(1) + "s"; }
    if (s < 60) { return Math.floor(s) + "s"; }
    if (s < 3600) { return Math.floor(s / 60) + "m"; }
    if (s < 172800) { return Math.floor(s / 3600) + "h" + (Math.floor(s / 60) % 60) + "m"; }
    return Math.floor(s / 86400) + "d";
  }
  function when(iso) {
    var d = new Date(iso);
    return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") + " (" + duration((Date.now() - d.getTime()) / 1000) + " ago)";
  }
  function cell(tag, text, cls) {
    var c = document.createElement(tag);
    c.textContent = text;
    if (cls) { c.className = cls; }
    return c;
  }

  function render(doc) {
    var asOf = document.getElementById("as-of");
    if (asOf && doc.as_of) {
      asOf.setAttribute("datetime", doc.as_of);
      asOf.textContent = when(doc.as_of);
    }
    var tbody = table.tBodies[0];
    var rows = document.createDocumentFragment();
    doc.consumers.forEach(function (c) {
      var tr = document.createElement("tr");
      tr.className = "consumer-row";
      tr.setAttribute("data-consumer", c.consumer);
      tr.setAttribute("data-store", c.store);
      var th = cell("th", c.consumer);
      th.setAttribute("scope", "row");
      tr.appendChild(th);
      // The SQL store is named after its engine (data-sql-store: "mysql" on MySQL).
      tr.appendChild(cell("td", c.store === "postgres" && table.dataset.sqlStore ? table.dataset.sqlStore : c.store));
      tr.appendChild(cell("td", num(c.done), "n"));
      tr.appendChild(cell("td", num(c.duplicates), "n"));
      var parked = cell("td", "", "n");
      var q = new URLSearchParams({ consumer: c.consumer });
      if (c.store === "redis") { q.set("store", "redis"); }
      var a = document.createElement("a");
      a.className = "parked-link";
      a.href = prefix + "/parked?" + q.toString();
      a.textContent = num(c.parked);
      var hidden = cell("span", " parked keys of " + c.consumer + ": list their messages", "visually-hidden");
      a.appendChild(hidden);
      parked.appendChild(a);
      tr.appendChild(parked);
      tr.appendChild(cell("td", num(c.parked_messages), "n"));
      tr.appendChild(cell("td", num(c.discarded), "n"));
      tr.appendChild(cell("td", num(c.failed), "n"));
      tr.appendChild(cell("td", num(c.processing), "n"));
      rows.appendChild(tr);
      if (c.error) {
        var er = document.createElement("tr");
        var td = cell("td", "Error: " + c.error, "error");
        td.setAttribute("colspan", "9");
        er.appendChild(td);
        rows.appendChild(er);
      }
    });
    if (doc.consumers.length > 0) {
      tbody.replaceChildren(rows);
    }
    var o = doc.outbox;
    var box = document.getElementById("outbox");
    if (o && box) {
      var set = function (field, text) {
        var dd = box.querySelector('[data-field="' + field + '"]');
        if (!dd) { return; }
        var link = dd.querySelector("a");
        if (link) { link.firstChild.nodeValue = text; } else { dd.textContent = text; }
      };
      set("pending", String(o.pending));
      set("oldest_pending_age", duration(o.oldest_pending_age_seconds));
      set("failing", String(o.failing));
      set("quarantined", String(o.quarantined));
      set("blocked_keys", String(o.blocked_keys));
      set("blocked_rows", String(o.blocked_rows));
    }
    var errors = document.getElementById("errors");
    if (errors) {
      var list = document.createDocumentFragment();
      doc.errors.forEach(function (e) { list.appendChild(cell("p", "Error: " + e, "error")); });
      errors.replaceChildren(list);
    }
  }

  var timer = null;
  function tick() {
    if (document.hidden) { return; }
    fetch(prefix + "/api/v1/overview", { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (res) {
        if (res.status === 401) {
          clearInterval(timer);
          var errors = document.getElementById("errors");
          if (errors) { errors.replaceChildren(cell("p", "Signed out: reload the page to sign in again. The figures are no longer refreshed.", "error")); }
          return null;
        }
        return res.ok ? res.json() : null;
      })
      .then(function (doc) { if (doc) { render(doc); } })
      .catch(function () { /* the next tick tries again */ });
  }
  timer = setInterval(tick, 5000);
})();
