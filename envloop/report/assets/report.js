/* The trajectory browser of envloop's run report: filter, search, sort and expand samples.
   All run text is inserted with textContent (never innerHTML), so it cannot become markup;
   images are the data: URI thumbnails of data.images, placed where their parts stand. */
(function () {
  "use strict";
  var PAGE = 100;
  var data = JSON.parse(document.getElementById("run-data").textContent);
  var samples = data.samples;
  var images = data.images || {};
  var $ = function (id) { return document.getElementById(id); };
  var ui = { task: $("f-task"), outcome: $("f-outcome"), sort: $("f-sort"), search: $("f-search"),
             list: $("traj-list"), count: $("traj-count"), more: $("more"), expand: $("f-expand") };
  var limit = PAGE;
  var query = "";

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function fmt(x) {
    if (x === null || x === undefined) return "-";
    if (typeof x !== "number") return String(x);
    return Number.isInteger(x) ? String(x) : String(Number(x.toPrecision(4)));
  }
  function pillClass(r) { return r > 0 ? "pill pos" : (r < 0 ? "pill neg" : "pill zero"); }
  function haystack(s) {
    if (s._text === undefined) {
      s._text = [s.task, s.ground_truth || "", s.error || ""].concat(
        s.messages.map(function (m) { return m.content || ""; })).join("\n").toLowerCase();
    }
    return s._text;
  }
  function preview(s) {
    var firstAssistant = s.messages.findIndex(function (m) { return m.role === "assistant"; });
    var prompt = s.messages.slice(0, firstAssistant < 0 ? s.messages.length : firstAssistant);
    var users = prompt.filter(function (m) { return m.role === "user"; });
    var text = (users.length ? users[users.length - 1] : (s.messages[0] || {})).content || "";
    text = text.replace(/\s+/g, " ").trim();
    return text.length > 160 ? text.slice(0, 157) + "…" : text;
  }

  function selected() {
    var task = ui.task.value, outcome = ui.outcome.value;
    var shown = samples.filter(function (s) {
      if (task && s.task !== task) return false;
      if (outcome === "pos" && !(s.total_reward > 0)) return false;
      if (outcome === "nonpos" && s.total_reward > 0) return false;
      if (outcome === "truncated" && !s.truncated) return false;
      if (outcome === "error" && !s.error) return false;
      return !query || haystack(s).indexOf(query) >= 0;
    });
    var key = { "reward-desc": function (s) { return -s.total_reward; },
                "reward-asc": function (s) { return s.total_reward; },
                "turns-desc": function (s) { return -s.num_turns; },
                "tokens-desc": function (s) { return -(s.tokens || 0); } }[ui.sort.value];
    if (key) shown.sort(function (a, b) { return key(a) - key(b) || a.sample - b.sample; });
    return shown;
  }

  function highlighted(text) {
    var frag = document.createDocumentFragment();
    if (!query) { frag.appendChild(document.createTextNode(text)); return frag; }
    var lower = text.toLowerCase(), at = 0, hit;
    while ((hit = lower.indexOf(query, at)) >= 0) {
      frag.appendChild(document.createTextNode(text.slice(at, hit)));
      frag.appendChild(el("mark", "", text.slice(hit, hit + query.length)));
      at = hit + query.length;
    }
    frag.appendChild(document.createTextNode(text.slice(at)));
    return frag;
  }

  function textBlock(text) {
    var block = el("pre", "msg-text");
    block.appendChild(highlighted(String(text)));
    return block;
  }
  // An image part: its thumbnail (a data: URI from the page's own data), else a note naming it.
  function image(p) {
    var thumb = images[p.image];
    if (!thumb) return el("div", "img-missing", "[image " + p.image + ": " + (p.note || "not shown") + "]");
    var img = document.createElement("img");
    img.className = "thumb";
    img.width = thumb.width;
    img.height = thumb.height;
    img.alt = thumb.alt;
    img.title = thumb.title;
    img.src = thumb.src;
    return img;
  }

  function body(s) {
    var box = el("div", "traj-body");
    var meta = el("div", "meta");
    var facts = [["dataset row", s.idx], ["generation", s.generation], ["ground truth", s.ground_truth],
                 ["turns", s.num_turns], ["tokens", s.tokens], ["terminated", s.terminated ? "yes" : "no"],
                 ["truncated", s.truncated ? "yes" : "no"]];
    Object.keys(s.rewards || {}).forEach(function (k) { facts.push([k, fmt(s.rewards[k])]); });
    facts.forEach(function (f) {
      var span = el("span", "", f[0] + " ");
      span.appendChild(el("b", "", fmt(f[1])));
      meta.appendChild(span);
    });
    box.appendChild(meta);
    if (s.error) box.appendChild(el("pre", "error", s.error));
    var turn = 0;
    s.messages.forEach(function (m) {
      var role = String(m.role || "?");
      var msg = el("div", "msg role-" + role.replace(/[^a-z0-9_-]/gi, ""));
      var head = el("div", "msg-head");
      if (role === "assistant") turn += 1;
      head.appendChild(el("span", "role", role));
      if (role === "assistant") head.appendChild(el("span", "", "turn " + turn));
      if (m.num_tokens !== null && m.num_tokens !== undefined) head.appendChild(el("span", "", m.num_tokens + " tokens"));
      if (m.reward !== null && m.reward !== undefined) {
        head.appendChild(el("span", "msg-reward " + pillClass(m.reward), "reward " + fmt(m.reward)));
      }
      msg.appendChild(head);
      if (m.parts) {
        var parts = el("div", "msg-parts");
        m.parts.forEach(function (p) { parts.appendChild(p.image !== undefined ? image(p) : textBlock(p.text)); });
        msg.appendChild(parts);
      } else {
        msg.appendChild(textBlock(m.content === null || m.content === undefined ? "" : m.content));
      }
      box.appendChild(msg);
    });
    return box;
  }

  function toggle(item, s, open) {
    var isOpen = item.classList.contains("open");
    if (open === undefined) open = !isOpen;
    if (open === isOpen) return;
    item.classList.toggle("open", open);
    item.querySelector(".traj-head").setAttribute("aria-expanded", open ? "true" : "false");
    if (open) item.appendChild(body(s)); else item.removeChild(item.querySelector(".traj-body"));
  }

  function row(s) {
    var item = el("div", "traj");
    item.id = "sample-" + s.sample;
    item.setAttribute("data-sample", s.sample);
    var head = el("button", "traj-head");
    head.type = "button";
    head.setAttribute("aria-expanded", "false");
    head.appendChild(el("span", "sample-id", "#" + s.sample));
    var task = el("span", "task");
    var dot = el("span", "dot");
    dot.style.background = data.colors[s.task] || "#98a2b3";
    task.appendChild(dot);
    task.appendChild(document.createTextNode(s.task));
    head.appendChild(task);
    head.appendChild(el("span", "preview", preview(s)));
    var flags = el("span", "stat", s.num_turns + (s.num_turns === 1 ? " turn" : " turns") + " · " + fmt(s.tokens) + " tok");
    if (s.truncated) flags.appendChild(el("span", "flag trunc", "truncated"));
    if (s.error) flags.appendChild(el("span", "flag err", "error"));
    head.appendChild(flags);
    head.appendChild(el("span", pillClass(s.total_reward), fmt(s.total_reward)));
    head.addEventListener("click", function () { toggle(item, s); });
    item.appendChild(head);
    return item;
  }

  function render() {
    var shown = selected();
    ui.list.textContent = "";
    shown.slice(0, limit).forEach(function (s) { ui.list.appendChild(row(s)); });
    if (!shown.length) ui.list.appendChild(el("p", "empty", "No sample matches these filters."));
    ui.count.textContent = "showing " + Math.min(limit, shown.length) + " of " + shown.length +
      (shown.length !== samples.length ? " matching (" + samples.length + " in the run)" : "");
    ui.more.hidden = shown.length <= limit;
    ui.more.textContent = "Show " + Math.min(PAGE, shown.length - limit) + " more";
    document.body.setAttribute("data-rendered", String(ui.list.querySelectorAll(".traj").length));
  }

  function byId(n) { return samples.find(function (s) { return String(s.sample) === n; }); }
  function openFromHash() {
    var match = /^#sample-(\d+)$/.exec(window.location.hash);
    var s = match && byId(match[1]);
    if (!s) return;
    var item = document.getElementById("sample-" + s.sample);
    if (!item) { limit = samples.length; ui.task.value = ""; ui.outcome.value = ""; render(); item = document.getElementById("sample-" + s.sample); }
    if (item) { toggle(item, s, true); item.scrollIntoView({ block: "start", behavior: "instant" }); }
  }

  Object.keys(data.colors).forEach(function (t) {
    var option = el("option", "", t);
    option.value = t;
    ui.task.appendChild(option);
  });
  [ui.task, ui.outcome, ui.sort].forEach(function (c) { c.addEventListener("change", function () { limit = PAGE; render(); }); });
  ui.search.addEventListener("input", function () { query = ui.search.value.trim().toLowerCase(); limit = PAGE; render(); });
  ui.more.addEventListener("click", function () { limit += PAGE; render(); });
  ui.expand.addEventListener("click", function () {
    var shown = selected().slice(0, limit);
    Array.prototype.forEach.call(ui.list.querySelectorAll(".traj"), function (item, i) { toggle(item, shown[i], true); });
  });
  window.addEventListener("hashchange", openFromHash);
  render();
  openFromHash();
  document.body.setAttribute("data-ready", "1");
})();
