// The token-credit viewer (advantage-service). Plain JavaScript, no dependencies, no external
// assets; every call is one fetch that ends: no connection stays open after the page loads.
//
// Testing contract: once a request is open, every token of every rollout is an element (in
// request order, none virtualised away) with data-token-id and data-advantage (the number the
// JSON response gives, in JavaScript's shortest form); its ancestors carry data-rollout and
// data-group. No other element has both token attributes. Positive values are shaded red,
// negative ones blue. document.body.dataset.state is "ready" when a request has rendered.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const TOKEN_KEY = "advantage-viewer-token";
  const NS_KEY = "advantage-viewer-namespace";
  // The scale's extremes; near-black text keeps >= 4.5:1 contrast on both and on white.
  const POS = [214, 96, 77];
  const NEG = [67, 147, 195];
  const KTAE_STATS = ["ktae_a", "ktae_b", "ktae_n_correct", "ktae_n_wrong", "ktae_p",
    "ktae_fisher", "ktae_ig", "ktae_h", "ktae_tf"];
  // Diagnostics that are not worth shading by (the statistics are shown per token instead).
  const NOT_SHADES = new Set(["scalar", "ktae_a", "ktae_b", "ktae_n_correct", "ktae_n_wrong"]);
  const CENTRES = { cscr_weight: 1 };

  const state = {
    token: sessionStorage.getItem(TOKEN_KEY) || "",
    config: null,
    view: null, // {request, response, rows: [{group, index, tokens, reward, values}], names}
    texts: new Map(),
    stats: [],
    statsSort: { key: null, dir: -1 },
  };

  // ---- calls -----------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, body) {
      const err = (body && body.error) || {};
      const what = status === 401 ? "not signed in (enter a bearer token)"
        : status === 403 ? "permission denied" : `HTTP ${status}`;
      super(`${what}: ${err.message || "no details"}${err.code ? ` (${err.code})` : ""}`);
      this.status = status;
      this.code = err.code;
    }
  }

  async function api(path, options = {}) {
    const headers = { Accept: "application/json", ...(options.headers || {}) };
    if (state.token) headers.Authorization = `Bearer ${state.token}`;
    if (options.body !== undefined && !headers["Content-Type"]) {
      headers["Content-Type"] = "application/json";
    }
    const answer = await fetch(path, { ...options, headers, cache: "no-store" });
    const text = await answer.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (e) { body = null; }
    if (!answer.ok) throw new ApiError(answer.status, body);
    return body;
  }

  function showError(err) {
    const box = $("error");
    if (!err) { box.hidden = true; box.textContent = ""; delete box.dataset.status; return; }
    box.textContent = err.message || String(err);
    box.dataset.status = err.status ? String(err.status) : "";
    box.hidden = false;
  }

  const namespace = () => $("namespace").value.trim() || "default";

  // ---- token text ------------------------------------------------------------------------------

  async function loadTexts(ids) {
    if (!state.config || !state.config.tokenizer) return;
    const missing = [...new Set(ids)].filter((i) => !state.texts.has(i));
    for (let at = 0; at < missing.length; at += 50000) {
      const chunk = missing.slice(at, at + 50000);
      const body = await api("/viewer/api/token-text", {
        method: "POST", body: JSON.stringify({ ids: chunk }),
      });
      if (!body.texts) return;
      for (const i of chunk) state.texts.set(i, body.texts[String(i)] ?? "");
    }
  }

  // What a token shows: its text with whitespace made visible, or its id.
  function tokenLabel(id) {
    if (!state.texts.has(id)) return null;
    const text = state.texts.get(id);
    if (text === "") return "\u2205";
    return text.replace(/\t/g, "\u2192\t").replace(/\n/g, "\u21b5\n");
  }

  // ---- shading ---------------------------------------------------------------------------------

  function mix(rgb, t) {
    const c = rgb.map((v) => Math.round(255 + (v - 255) * t));
    return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
  }

  function shadeFor(value, centre, scale) {
    if (!Number.isFinite(value) || scale <= 0) return "rgb(255, 255, 255)";
    const t = Math.max(-1, Math.min(1, (value - centre) / scale));
    return t >= 0 ? mix(POS, t) : mix(NEG, -t);
  }

  function shadeBy(name) {
    const view = state.view;
    if (!view) return;
    const centre = CENTRES[name] ?? 0;
    let scale = 0;
    for (const row of view.rows) {
      const values = row.values[name];
      if (!values) continue;
      for (const v of values) scale = Math.max(scale, Math.abs(v - centre));
    }
    for (const row of view.rows) {
      const values = row.values[name] || [];
      const spans = row.element.children;
      for (let t = 0; t < spans.length; t++) {
        spans[t].style.backgroundColor = shadeFor(values[t], centre, scale);
      }
    }
    const lo = centre - scale;
    const hi = centre + scale;
    $("legend-text").textContent = `${fmt(lo)} (blue) \u2026 ${fmt(centre)} \u2026 ${fmt(hi)} (red)`;
    document.body.dataset.shade = name;
  }

  // ---- numbers ---------------------------------------------------------------------------------

  function fmt(v) {
    if (v === undefined || v === null) return "\u2013";
    if (!Number.isFinite(v)) return String(v);
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e5 || a < 1e-4) return v.toExponential(4);
    return String(Number(v.toPrecision(6)));
  }

  // ---- a request -------------------------------------------------------------------------------

  function rowsOf(request, response) {
    const rows = [];
    const groups = request.groups || [];
    response.groups.forEach((group, g) => {
      const given = (groups[g] && groups[g].rollouts) || [];
      group.rollouts.forEach((out, i) => {
        const input = given[i] || {};
        const values = {};
        for (const [name, v] of Object.entries(out)) {
          if (Array.isArray(v)) values[name] = v;
        }
        rows.push({
          group: group.id, index: i, tokens: input.tokens || [], reward: input.reward,
          components: input.reward_components || null, scalar: out.scalar, values, element: null,
        });
      });
    });
    return rows;
  }

  function threshold(estimator) {
    return (estimator && estimator.ktae && estimator.ktae.correct_threshold) || 0;
  }

  function el(tag, attrs = {}, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  async function showRequest(request, response) {
    const rows = rowsOf(request, response);
    const names = ["advantages"];
    for (const row of rows) {
      for (const name of Object.keys(row.values)) {
        if (!names.includes(name) && !NOT_SHADES.has(name)) names.push(name);
      }
    }
    state.view = { request, response, rows, names };
    await loadTexts(rows.flatMap((r) => r.tokens)).catch(showError);

    $("request-id").textContent = response.request_id || "";
    const select = $("shade");
    select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
    const container = $("groups");
    container.replaceChildren();
    const cut = threshold(response.estimator);
    let at = 0;
    const fragment = document.createDocumentFragment();
    for (const group of response.groups) {
      const mine = rows.slice(at, at + group.rollouts.length);
      at += group.rollouts.length;
      const rewards = mine.map((r) => r.reward);
      const correct = rewards.filter((r) => r > cut).length;
      const zero = rewards.every((r) => r === rewards[0]);
      const box = el("section", { class: "group", "data-group": group.id });
      const head = el("h3");
      head.append(el("strong", {}, `group ${group.id}`));
      head.append(el("span", {}, `rewards [${rewards.map(fmt).join(", ")}]`));
      head.append(el("span", {}, `accuracy ${fmt(rewards.length ? correct / rewards.length : 0)}`
        + ` (${correct}/${rewards.length} > ${fmt(cut)})`));
      if (zero) head.append(el("span", { class: "flag", title: "every reward equal" }, "zero signal"));
      box.append(head);
      for (const row of mine) box.append(rolloutElement(row));
      fragment.append(box);
    }
    container.append(fragment);
    $("request").hidden = false;
    shadeBy("advantages");
    document.body.dataset.state = "ready";
  }

  function rolloutElement(row) {
    const box = el("div", { class: "rollout", "data-rollout": String(row.index), "data-group": row.group });
    const advantages = row.values.advantages || [];
    const parts = [`rollout ${row.index}`, `reward ${fmt(row.reward)}`];
    if (row.scalar !== undefined) parts.push(`scalar advantage ${fmt(row.scalar)}`);
    parts.push(`${row.tokens.length} tokens`);
    box.append(el("div", { class: "rollout-head" }, parts.join(" \u00b7 ")));
    const tokens = el("div", {
      class: "tokens", role: "group", "aria-label": `group ${row.group} rollout ${row.index} tokens`,
    });
    const ids = row.tokens;
    for (let t = 0; t < ids.length; t++) {
      const label = tokenLabel(ids[t]);
      const span = document.createElement("span");
      span.className = label === null ? "tok id" : "tok";
      span.textContent = label === null ? String(ids[t]) : label;
      span.dataset.tokenId = String(ids[t]);
      span.dataset.advantage = String(advantages[t]);
      span.dataset.t = String(t);
      span.tabIndex = t === 0 ? 0 : -1;
      tokens.append(span);
    }
    row.element = tokens;
    tokens.rowRef = row;
    box.append(tokens);
    return box;
  }

  // ---- why a token got its credit --------------------------------------------------------------

  function dl(pairs) {
    const list = el("dl");
    for (const [name, value, stat] of pairs) {
      list.append(el("dt", {}, name));
      const dd = el("dd", {}, typeof value === "number" ? fmt(value) : String(value));
      if (stat) { dd.dataset.stat = stat; dd.dataset.value = String(value); }
      list.append(dd);
    }
    return list;
  }

  function showDetails(span) {
    const tokens = span.parentElement;
    const row = tokens && tokens.rowRef;
    if (!row) return;
    const t = Number(span.dataset.t);
    const v = (name) => (row.values[name] ? row.values[name][t] : undefined);
    const estimator = state.view.response.estimator || {};
    document.querySelectorAll(".tok.selected").forEach((s) => s.classList.remove("selected"));
    span.classList.add("selected");
    const body = $("detail-body");
    body.replaceChildren();
    const id = Number(span.dataset.tokenId);
    const text = state.texts.has(id) ? JSON.stringify(state.texts.get(id)) : "(no tokenizer)";
    body.append(dl([
      ["token id", id, "token_id"], ["text", text], ["group", row.group],
      ["rollout", row.index], ["position", t], ["advantage", v("advantages"), "advantage"],
    ]));
    const weight = v("cscr_weight");
    const credit = [];
    if (row.scalar !== undefined) {
      credit.push(["outcome a_i", row.scalar, "scalar"]);
      credit.push(["weight w", weight ?? 1, "weight"]);
      credit.push(["outcome term a_i \u00b7 w", row.scalar * (weight ?? 1), "outcome_term"]);
    } else if (weight !== undefined) {
      credit.push(["weight w", weight, "weight"]);
    }
    if (v("otb_baseline") !== undefined) credit.push(["OTB baseline", v("otb_baseline"), "otb_baseline"]);
    const outcome = (estimator.outcome && estimator.outcome.name) || "";
    if (outcome === "maxrl") {
      // a_i = (r_i - p) / (p + eps): the group's success rate p divides the centred reward.
      const rewards = state.view.rows.filter((r) => r.group === row.group).map((r) => r.reward);
      const p = rewards.reduce((a, b) => a + b, 0) / (rewards.length || 1);
      credit.push(["MaxRL success rate p", p, "maxrl_rate"]);
      credit.push(["MaxRL r − p", row.reward - p, "maxrl_centred"]);
    }
    if (outcome === "gdpo" && row.components) {
      gdpoShares(row, estimator.outcome).forEach((c) => credit.push(c));
    }
    if (v("gtpo_reward") !== undefined) {
      credit.push(["GTPO shaped reward r̃ (entropy share)", v("gtpo_reward"), "gtpo_reward"]);
    }
    if (v("grpo_s_reward") !== undefined) {
      credit.push(["GRPO-S shaped reward (mean entropy)", v("grpo_s_reward"), "grpo_s_reward"]);
    }
    if (v("ktae_score") !== undefined) credit.push(["bonus: KTAE score", v("ktae_score"), "ktae_score"]);
    if (v("opsd_reward") !== undefined) {
      const coef = (estimator.opsd && estimator.opsd.coef) ?? 1;
      credit.push([`bonus: OPSD ${fmt(coef)} \u00d7 d`, coef * v("opsd_reward"), "opsd_bonus"]);
    }
    if (v("planning_mask") !== undefined) {
      const alpha = (estimator.hicra && estimator.hicra.alpha) ?? 0.2;
      credit.push(["HICRA planning token", v("planning_mask") === 1 ? "yes" : "no", "planning_mask"]);
      if (v("hicra_bonus") !== undefined) {
        credit.push([`HICRA ${fmt(alpha)} × |A| × m`, v("hicra_bonus"), "hicra_bonus"]);
      }
    }
    if (v("forking_mask") !== undefined) credit.push(["forking mask", v("forking_mask"), "forking_mask"]);
    if (credit.length) {
      body.append(el("h3", {}, "Credit"));
      body.append(dl(credit));
    }
    if (v("ktae_a") !== undefined) body.append(ktaeTable(v));
    else if (v("ktae_score") !== undefined) {
      body.append(el("p", { class: "muted" }, "Ask for the ktae_* statistics to see the table."));
    }
    if (v("sensitivity") !== undefined) {
      body.append(el("h3", {}, "CSCR"));
      body.append(dl([["sensitivity s", v("sensitivity"), "sensitivity"], ["weight w", weight, "cscr_weight"]]));
    }
  }

  // GDPO: each reward component normalised within the group, A_ik = (r_ik - mean) / (std + eps)
  // over the rollouts that gave it (verl: eps 1e-6, a group of one mean 0 std 1; trl: eps 1e-4,
  // 0 below two values), and its weighted share w_k A_ik of the sum the request then normalises.
  function gdpoShares(row, outcome) {
    const trl = outcome.normalization === "trl";
    const eps = trl ? 1e-4 : 1e-6;
    const weights = outcome.weights || {};
    const group = state.view.rows.filter((r) => r.group === row.group);
    const out = [];
    let sum = 0;
    for (const name of Object.keys(row.components).sort()) {
      const own = row.components[name];
      const w = weights[name] ?? 1;
      const given = group.map((r) => (r.components || {})[name]).filter((x) => x !== null && x !== undefined);
      let a = 0;
      if (own !== null && own !== undefined && given.length > 0) {
        if (given.length === 1) {
          a = trl ? 0 : own / (1 + eps);
        } else {
          const mean = given.reduce((p, q) => p + q, 0) / given.length;
          const sq = given.reduce((p, q) => p + (q - mean) ** 2, 0);
          a = (own - mean) / (Math.sqrt(sq / (given.length - 1)) + eps);
        }
      }
      sum += w * a;
      out.push([`GDPO ${name}: w \u00b7 A (r = ${fmt(own)})`, w * a, `gdpo_share_${name}`]);
    }
    out.push(["GDPO sum S (then normalised over the request)", sum, "gdpo_sum"]);
    return out;
  }

  function ktaeTable(v) {
    const a = v("ktae_a"); const b = v("ktae_b");
    const nc = v("ktae_n_correct"); const nw = v("ktae_n_wrong");
    const box = el("div", { id: "ktae-details" });
    box.append(el("h3", {}, "KTAE contingency table"));
    const table = el("table", { id: "ktae-table" });
    table.append(el("caption", { class: "muted" }, "rollouts of the group"));
    const head = el("tr");
    head.append(el("td"), el("th", { scope: "col" }, "correct C"), el("th", { scope: "col" }, "wrong W"));
    const cell = (value, stat) => {
      const td = el("td", {}, fmt(value));
      td.dataset.stat = stat; td.dataset.value = String(value);
      return td;
    };
    const present = el("tr");
    present.append(el("th", { scope: "row" }, "token present"), cell(a, "a"), cell(b, "b"));
    const absent = el("tr");
    absent.append(el("th", { scope: "row" }, "absent"), cell(nc - a, "c"), cell(nw - b, "d"));
    const total = el("tr");
    total.append(el("th", { scope: "row" }, "total"), cell(nc, "n_correct"), cell(nw, "n_wrong"));
    table.append(head, present, absent, total);
    box.append(table);
    const f = v("ktae_fisher"); const ig = v("ktae_ig"); const h = v("ktae_h"); const tf = v("ktae_tf");
    box.append(dl([
      ["Fisher p", v("ktae_p"), "p"], ["F = exp(\u22122p)", f, "F"], ["IG (bits)", ig, "IG"],
      ["Cohen's h", h, "h"], ["tf contrast", tf, "tf"], ["score kt", v("ktae_score"), "score"],
    ]));
    return box;
  }

  function onTokenEvent(event) {
    const span = event.target.closest && event.target.closest(".tok");
    if (span) showDetails(span);
  }

  function onTokenKey(event) {
    const span = event.target.closest && event.target.closest(".tok");
    if (!span) return;
    const tokens = span.parentElement.children;
    const t = Number(span.dataset.t);
    const to = { ArrowRight: t + 1, ArrowLeft: t - 1, Home: 0, End: tokens.length - 1 }[event.key];
    if (to === undefined || to < 0 || to >= tokens.length) return;
    event.preventDefault();
    span.tabIndex = -1;
    tokens[to].tabIndex = 0;
    tokens[to].focus();
  }

  // ---- opening requests ------------------------------------------------------------------------

  async function computePasted() {
    showError(null);
    const status = $("compute-state");
    let request;
    try {
      request = JSON.parse($("request-json").value);
    } catch (e) {
      showError(new Error(`the request is not JSON: ${e.message}`));
      return;
    }
    if (!request || typeof request !== "object" || Array.isArray(request)) {
      showError(new Error("the request must be a JSON object"));
      return;
    }
    status.textContent = "computing\u2026";
    try {
      if (request.namespace === undefined) request.namespace = namespace();
      // Every diagnostic the estimator produces, so that each token can be explained.
      const listing = await api("/viewer/api/diagnostics", {
        method: "POST", body: JSON.stringify({ estimator: request.estimator ?? null }),
      });
      request.return = [...new Set([...(request.return || []), ...listing.diagnostics])];
      const response = await api("/v1/advantages", { method: "POST", body: JSON.stringify(request) });
      status.textContent = `computed ${response.request_id}`;
      await showRequest(request, response);
      refreshRecent();
    } catch (err) {
      status.textContent = "";
      showError(err);
    }
  }

  async function openKept(requestId, ns) {
    showError(null);
    try {
      const kept = await api(
        `/viewer/api/requests/${encodeURIComponent(requestId)}?namespace=${encodeURIComponent(ns)}`,
      );
      await showRequest(kept.request, kept.response);
    } catch (err) {
      document.body.dataset.state = "error";
      showError(err);
    }
  }

  async function refreshRecent() {
    const list = $("recent");
    const note = $("recent-note");
    if (!state.config || !state.config.keep) {
      note.textContent = "This server keeps no requests (ADV_VIEWER_KEEP=0): paste one.";
      list.replaceChildren();
      return;
    }
    const ns = namespace();
    try {
      const body = await api(`/viewer/api/recent?namespace=${encodeURIComponent(ns)}`);
      const where = state.config.keep_store === "redis" ? " (kept in Redis: any replica shows them)" : "";
      note.textContent = `The last ${body.keep} requests computed over HTTP in ${ns}, newest first${where}.`;
      list.replaceChildren(...body.requests.map((r) => {
        const item = el("li");
        const href = `/viewer?request_id=${encodeURIComponent(r.request_id)}&namespace=${encodeURIComponent(ns)}`;
        const link = el("a", { href }, r.request_id);
        item.append(link, document.createTextNode(
          ` \u00b7 ${r.estimator} \u00b7 ${r.groups} groups, ${r.rollouts} rollouts, ${r.tokens} tokens`));
        return item;
      }));
      if (!body.requests.length) note.textContent += " None yet.";
    } catch (err) {
      note.textContent = "";
      list.replaceChildren();
      showError(err);
    }
  }

  // ---- namespace statistics --------------------------------------------------------------------

  async function loadStats() {
    showError(null);
    const ns = namespace();
    const order = $("stats-order").value;
    const limit = Math.max(1, Math.min(10000, Number($("stats-limit").value) || 50));
    $("stats-state").textContent = "loading\u2026";
    try {
      const body = await api(`/v1/stats/tokens?namespace=${encodeURIComponent(ns)}&order=${order}&limit=${limit}`);
      await loadTexts(body.tokens.map((t) => t.token_id)).catch(showError);
      state.stats = body.tokens.map((t) => ({ ...t, text: state.texts.get(t.token_id) ?? "" }));
      state.statsSort = { key: null, dir: -1 };
      $("stats-caption").textContent =
        `${ns}: ${body.rollouts_counted} rollouts counted; top ${body.tokens.length} by ${order}`;
      $("stats-state").textContent = "";
      renderStats();
    } catch (err) {
      $("stats-state").textContent = "";
      showError(err);
    }
  }

  function renderStats() {
    const rows = [...state.stats];
    const { key, dir } = state.statsSort;
    if (key) {
      rows.sort((x, y) => {
        const a = x[key] ?? -Infinity; const b = y[key] ?? -Infinity;
        return (a < b ? -1 : a > b ? 1 : 0) * dir;
      });
    }
    const maxOf = (k) => Math.max(0, ...rows.map((r) => Math.abs(r[k] ?? 0)));
    const scales = { key_score: maxOf("key_score"), mean_sensitivity: maxOf("mean_sensitivity"),
      occurrences: maxOf("occurrences") };
    const barCell = (value, k) => {
      const td = el("td", { class: "bar-cell" });
      if (value !== null && value !== undefined && scales[k] > 0) {
        const fill = el("span", { class: `bar-fill${value > 0 ? " pos" : ""}`, "aria-hidden": "true" });
        fill.style.width = `${(100 * Math.abs(value)) / scales[k]}%`;
        td.append(fill);
      }
      td.append(el("span", {}, fmt(value)));
      return td;
    };
    $("stats-table").querySelector("tbody").replaceChildren(...rows.map((r) => {
      const tr = el("tr", { "data-stat-token": String(r.token_id) });
      tr.append(el("td", {}, String(r.token_id)), el("td", { class: "text" }, r.text ? JSON.stringify(r.text) : ""),
        el("td", {}, String(r.correct_rollouts)), el("td", {}, String(r.wrong_rollouts)),
        barCell(r.occurrences, "occurrences"), barCell(r.key_score, "key_score"),
        barCell(r.mean_sensitivity, "mean_sensitivity"));
      return tr;
    }));
    for (const th of $("stats-table").querySelectorAll("th")) {
      const button = th.querySelector("button");
      th.setAttribute("aria-sort", button && button.dataset.sort === key
        ? (dir > 0 ? "ascending" : "descending") : "none");
    }
    $("stats-table").hidden = false;
  }

  // ---- start -----------------------------------------------------------------------------------

  function updateAuthState() {
    const auth = state.config && state.config.auth;
    $("auth-state").textContent = !auth ? "this server needs no token"
      : state.token ? "token set for this tab" : "this server needs a token";
  }

  async function start() {
    $("token").value = state.token;
    $("namespace").value = sessionStorage.getItem(NS_KEY) || "default";
    const params = new URLSearchParams(location.search);
    if (params.get("namespace")) $("namespace").value = params.get("namespace");
    $("auth-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.token = $("token").value.trim();
      sessionStorage.setItem(TOKEN_KEY, state.token);
      updateAuthState();
      showError(null);
      refreshRecent();
      const id = params.get("request_id");
      if (id) openKept(id, namespace());
    });
    $("namespace").addEventListener("change", () => {
      sessionStorage.setItem(NS_KEY, namespace());
      refreshRecent();
    });
    $("compute").addEventListener("click", computePasted);
    $("refresh-recent").addEventListener("click", refreshRecent);
    $("request-file").addEventListener("change", async (event) => {
      const file = event.target.files[0];
      if (!file) return;
      $("request-json").value = await file.text();
      computePasted();
    });
    $("shade").addEventListener("change", (event) => shadeBy(event.target.value));
    const groups = $("groups");
    groups.addEventListener("mouseover", onTokenEvent);
    groups.addEventListener("focusin", onTokenEvent);
    groups.addEventListener("keydown", onTokenKey);
    $("load-stats").addEventListener("click", loadStats);
    $("stats-table").querySelector("thead").addEventListener("click", (event) => {
      const button = event.target.closest("button");
      if (!button) return;
      const key = button.dataset.sort;
      const dir = state.statsSort.key === key ? -state.statsSort.dir : -1;
      state.statsSort = { key, dir };
      renderStats();
    });
    try {
      state.config = await api("/viewer/api/config");
    } catch (err) {
      showError(err);
    }
    updateAuthState();
    const id = params.get("request_id");
    const pending = [refreshRecent()];
    if (id) pending.push(openKept(id, namespace()));
    await Promise.all(pending);
    if (!id) document.body.dataset.state = "idle";
  }

  start();
})();
