// The trajectory viewer of report.html. The page's data is one gzip+base64 JSON object (see htmlreport.py):
// pairs column by column, token sequences stored once, each candidate as its tail after the first divergence.
// (after common.js: $, unpack, el)

const PAGE = 200;  // rows added per "show more"
function fmt(x, digits) {
  return x === null || x === undefined ? "—" : typeof x === "number" && digits !== undefined ? x.toFixed(digits) : String(x);
}

// ---- the pairs table ------------------------------------------------------------------------------------
class Viewer {
  constructor(data) {
    this.d = data;
    this.p = data.pairs;
    this.n = this.p.key.length;
    this.byKey = new Map(this.p.key.map((k, i) => [k, i]));
    this.sort = { col: null, dir: 1 };
    this.shown = PAGE;
    this.rows = [];
    this.open = null;
  }

  init() {
    const fill = (id, values) => {
      const select = $(id);
      values.forEach((v, i) => select.append(el("option", { value: String(i), textContent: v })));
    };
    fill("f-config", this.d.names.config);
    fill("f-domain", this.d.names.domain);
    fill("f-candidate", this.d.names.candidate);
    for (const id of ["f-config", "f-domain", "f-candidate", "f-status", "f-mmin", "f-mmax", "f-search"]) {
      $(id).addEventListener("input", () => { this.shown = PAGE; this.refresh(); });
    }
    document.querySelectorAll("#pairs th").forEach((th) => th.addEventListener("click", () => this.sortBy(th)));
    $("more").addEventListener("click", () => { this.shown += PAGE; this.draw(); });
    for (const note of this.d.notes) $("notes").append(el("li", { textContent: note }));
    window.addEventListener("hashchange", () => this.fromHash());
    this.refresh();
    this.fromHash();
  }

  filtered() {
    const p = this.p;
    const num = (id) => ($(id).value === "" ? null : Number($(id).value));
    const cfg = $("f-config").value, dom = $("f-domain").value, cand = $("f-candidate").value;
    const status = $("f-status").value, lo = num("f-mmin"), hi = num("f-mmax");
    const text = $("f-search").value.trim().toLowerCase();
    const out = [];
    for (let i = 0; i < this.n; i++) {
      if (cfg !== "" && p.cfg[i] !== +cfg) continue;
      if (dom !== "" && p.dom[i] !== +dom) continue;
      if (cand !== "" && p.cand[i] !== +cand) continue;
      if (status === "matched" && !p.match[i]) continue;
      if (status === "diverged" && p.match[i]) continue;
      if ((lo !== null || hi !== null) && p.rm[i] === null) continue;
      if (lo !== null && p.rm[i] < lo) continue;
      if (hi !== null && p.rm[i] > hi) continue;
      if (text && !p.key[i].toLowerCase().includes(text)) continue;
      out.push(i);
    }
    return out;
  }

  value(col, i) {
    const v = this.p[col][i];
    if (col === "dom") return this.d.names.domain[v];
    if (col === "cfg") return this.d.names.config[v];
    if (col === "cand") return this.d.names.candidate[v];
    return v;
  }

  sortBy(th) {
    const col = th.dataset.col;
    this.sort = { col, dir: this.sort.col === col ? -this.sort.dir : 1 };
    document.querySelectorAll("#pairs th").forEach((h) => h.classList.remove("sorted-asc", "sorted-desc"));
    th.classList.add(this.sort.dir > 0 ? "sorted-asc" : "sorted-desc");
    this.refresh();
  }

  refresh() {
    const rows = this.filtered();
    const { col, dir } = this.sort;
    if (col) {
      rows.sort((a, b) => {
        const x = this.value(col, a), y = this.value(col, b);
        if (x === y) return a - b;
        if (x === null || x === undefined) return 1;  // missing values last, either way
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * dir;
      });
    }
    this.rows = rows;
    this.draw();
  }

  draw() {
    const body = document.querySelector("#pairs tbody");
    const part = document.createDocumentFragment();
    const p = this.p;
    for (const i of this.rows.slice(0, this.shown)) {
      const tr = el("tr");
      tr.dataset.key = p.key[i];
      if (this.open === i) tr.classList.add("open");
      const cells = [
        [p.pid[i]], [this.value("dom", i)], [this.value("cfg", i)], [this.value("cand", i)],
        [p.match[i] ? "yes" : "no", p.match[i] ? "yes" : "no"], [fmt(p.div[i]), "num"], [fmt(p.rm[i]), "num"],
        [fmt(p.lev[i]), "num"], [fmt(p.ppl[i], 3), "num"],
      ];
      for (const [text, cls] of cells) tr.append(el("td", { textContent: text, className: cls || "" }));
      tr.addEventListener("click", () => { location.hash = encodeURIComponent(p.key[i]); });
      part.append(tr);
    }
    body.replaceChildren(part);
    $("count").value = `${this.rows.length} of ${this.n} pairs`;
    $("more").hidden = this.rows.length <= this.shown;
  }

  fromHash() {
    const raw = location.hash.slice(1);
    if (!raw || raw === "overview" || raw === "trajectories") return;
    let key;
    try { key = decodeURIComponent(raw); } catch (e) { key = raw; }
    // a link from before ids named kernel builds (`key` without `@<digest>`): the first pair of that key
    let i = this.byKey.get(key);
    if (i === undefined) i = this.p.key.findIndex((k) => k.startsWith(key + "@"));
    if (i === -1) i = undefined;
    if (i === undefined) {
      this.showPanel([el("p", { textContent: `No pair with key ${key} in this report.` })]);
      return;
    }
    this.openPair(i);
  }

  // ---- one pair ------------------------------------------------------------------------------------------
  tok(id, pos, cls) {
    const text = this.d.tokens[String(id)];
    return el("span", {
      className: "t" + (cls ? " " + cls : ""), textContent: text === undefined ? `⟨${id}⟩` : text,
      title: `token ${id}, position ${pos}`,
    });
  }

  tokens(ids, start, marks) {
    const box = el("div", { className: "text" });
    ids.forEach((id, j) => box.append(this.tok(id, start + j, marks ? marks(start + j) : "")));
    if (!ids.length) box.append(el("em", { textContent: "(nothing)" }));
    return box;
  }

  topTable(title, top, chosen) {
    if (!top) return el("div", {}, el("strong", { textContent: title }), el("p", { textContent: "not recorded" }));
    const table = el("table", {}, el("tr", {}, el("th", { textContent: "token" }), el("th", { textContent: "id" }),
      el("th", { textContent: "logit", className: "num" })));
    for (const [id, logit] of top) {
      const tr = el("tr", { className: id === chosen ? "chosen" : "" });
      const text = this.d.tokens[String(id)];
      tr.append(el("td", { className: "tok", textContent: text === undefined ? `⟨${id}⟩` : JSON.stringify(text) }),
        el("td", { textContent: String(id), className: "num" }), el("td", { textContent: logit.toFixed(4), className: "num" }));
      table.append(tr);
    }
    return el("div", {}, el("strong", { textContent: title }), table);
  }

  openPair(i) {
    const d = this.d, p = this.p;
    this.open = i;
    const ref = d.seqs[p.ref[i]];
    const matched = !!p.match[i];
    const div = p.div[i];
    const tail = matched ? [] : d.seqs[p.tail[i]];
    const cand = matched ? ref : ref.slice(0, div).concat(tail);
    const parts = [];
    const close = el("button", { type: "button", className: "close", textContent: "close" });
    close.addEventListener("click", () => { history.replaceState(null, "", "#trajectories"); this.closePair(); });
    const link = el("a", { href: "#" + encodeURIComponent(p.key[i]), textContent: "permalink" });
    parts.push(close, el("h2", { textContent: p.key[i] }));
    parts.push(el("p", { className: "meta" },
      `${this.value("dom", i)} · ${this.value("cfg", i)} · candidate ${this.value("cand", i)} · `,
      el("span", { className: matched ? "yes" : "no", textContent: matched ? "matched" : `diverged at token ${div}` }),
      matched ? "" : ` · Levenshtein ${fmt(p.lev[i])} · reference margin there ${fmt(p.rm[i])}` +
        ` · candidate margin there ${fmt(p.om[i])}`, " · ", link));
    const prompt = d.prompts[p.pid[i]];
    parts.push(el("h3", { textContent: "Prompt" }),
      el("div", { className: "prompt", textContent: prompt === undefined ? "(the prompt's text is not in this report)" : prompt }));
    const toggle = el("input", { type: "checkbox", id: "tok-toggle" });
    toggle.addEventListener("change", () => $("pair").classList.toggle("tokens", toggle.checked));
    parts.push(el("label", {}, toggle, " show token boundaries"));
    if (matched) {
      parts.push(el("h3", { textContent: `Both continuations (${ref.length} tokens, identical)` }), this.tokens(ref, 0));
    } else {
      const rj = p.rejoin[i];
      const mark = (start, end) => (pos) => (pos === div ? "div" : rj && pos >= start && pos < end ? "rejoin" : "");
      parts.push(el("h3", { textContent: `Shared prefix (${div} tokens)` }), this.tokens(ref.slice(0, div), 0));
      parts.push(el("h3", { textContent: "From the first divergence" }));
      parts.push(el("div", { className: "side" },
        el("span", { className: "label", textContent: "reference" }),
        this.tokens(ref.slice(div), div, rj ? mark(rj[0], rj[0] + rj[2]) : mark(0, 0)),
        el("span", { className: "label", textContent: "candidate" }),
        this.tokens(cand.slice(div), div, rj ? mark(rj[1], rj[1] + rj[2]) : mark(0, 0))));
      parts.push(el("p", {
        className: "rejoin-note",
        textContent: rj
          ? `The texts meet again: reference token ${rj[0]} = candidate token ${rj[1]}, then ${rj[2]} tokens agree.`
          : `The texts do not meet again within the generated tokens (no ${this.d.rejoin_tokens} equal tokens in a row after the divergence).`,
      }));
      parts.push(el("h3", { textContent: `Top tokens at token ${div}` }),
        el("div", { className: "tops" },
          this.topTable("reference (AR greedy)", p.rt[i], ref[div]),
          this.topTable("candidate", p.ot[i], cand[div])));
      const hint = p.tb[i] === 1
        ? "These top tokens were found after the audit, by decoding the pair again up to the divergence on the machine that made it (lossless backfill); the tokens and the margin came out as recorded."
        : p.tb[i] === 0
          ? "Decoded again up to the divergence on the machine that made it, the pair did not reproduce its recorded tokens, so no top tokens are shown."
          : !p.rt[i] ? "Top tokens are recorded by audits from this version on; older records keep the margin only." : null;
      if (hint) parts.push(el("p", { className: "hint", textContent: hint }));
    }
    if (p.xref[i] === p.ref[i]) {  // the view above is already against it
      parts.push(el("p", { className: "against" }, `The pair's AR reference is equal to ${d.reference_label}, the report's reference.`));
    } else if (p.xref[i] >= 0) parts.push(...this.against(d.seqs[p.xref[i]], ref, cand));
    this.showPanel(parts);
    this.draw();
  }

  // the pair beside the report's reference configuration's AR trajectory of the same prompt (e.g. fp32 AR)
  against(x, ref, cand) {
    const label = this.d.reference_label;
    const parts = (a) => {
      let j = 0;
      while (j < a.length && j < x.length && a[j] === x[j]) j++;
      return j === a.length && j === x.length ? null : j;
    };
    const say = (who, a) => {
      const j = parts(a);
      return j === null ? `${who}: equal to ${label}.` : `${who}: parts from ${label} at token ${j}` +
        ` (${a.length} tokens against ${x.length}).`;
    };
    const out = [el("h3", { textContent: `Against ${label}, the report's reference` }),
      el("p", { className: "against" }, say("the pair's AR reference", ref), " ", say("the candidate", cand))];
    const j = parts(cand);
    if (j !== null) {
      out.push(el("div", { className: "side" },
        el("span", { className: "label", textContent: label }),
        this.tokens(x.slice(j), j, (pos) => (pos === j ? "xdiv" : "")),
        el("span", { className: "label", textContent: "candidate" }),
        this.tokens(cand.slice(j), j, (pos) => (pos === j ? "xdiv" : ""))));
    }
    return out;
  }

  showPanel(parts) {
    const panel = $("pair");
    panel.replaceChildren(...parts);
    panel.classList.remove("tokens");
    panel.hidden = false;
    panel.scrollIntoView({ block: "start" });
  }

  closePair() {
    this.open = null;
    $("pair").hidden = true;
    this.draw();
  }
}

// ---- sortable overview tables ---------------------------------------------------------------------------
function sortable(table) {
  const head = table.querySelector("thead tr");
  const body = table.querySelector("tbody");
  if (!head || !body) return;
  const key = (cell) => {
    const text = cell.textContent.trim();
    const num = parseFloat(text.replace(/^[^\d.-]+/, ""));
    return Number.isNaN(num) ? text : num;
  };
  [...head.children].forEach((th, col) => {
    let dir = 1;
    th.addEventListener("click", () => {
      const rows = [...body.rows];
      rows.sort((a, b) => {
        const x = key(a.cells[col]), y = key(b.cells[col]);
        if (typeof x !== typeof y) return (typeof x === "number" ? -1 : 1) * dir;
        return (x < y ? -1 : x > y ? 1 : 0) * dir;
      });
      body.append(...rows);
      head.querySelectorAll("th").forEach((h) => h.classList.remove("sorted-asc", "sorted-desc"));
      th.classList.add(dir > 0 ? "sorted-asc" : "sorted-desc");
      dir = -dir;
    });
  });
}

(async () => {
  document.querySelectorAll("#overview table").forEach(sortable);
  const started = performance.now();
  const data = await unpack($("data").textContent);
  const viewer = new Viewer(data);
  viewer.init();
  window.lossless = viewer;  // for the console, and for tests
  $("status").textContent = `${viewer.n} pairs, ready in ${Math.round(performance.now() - started)} ms`;
  document.body.dataset.ready = "1";
})().catch((err) => {
  $("status").textContent = `this page could not read its data: ${err}`;
  console.error(err);
});
