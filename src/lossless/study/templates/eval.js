// The item viewer of an evaluation's report.html: task items whose AR and Orthrus responses differ.
// (after common.js: $, unpack, el)

function firstDifference(a, b) {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return i;
}

function parted(text, at) {  // the shared start greyed, the first differing character marked
  return el("div", { className: "text" }, el("span", { className: "shared", textContent: text.slice(0, at) }),
    el("span", { className: "t div", textContent: text.slice(at, at + 1) || "∅" }), text.slice(at + 1));
}

function render(data) {
  const items = data.items;
  const byKey = new Map(items.map((it, i) => [it.key, i]));
  const values = (name) => [...new Set(items.map((it) => it[name]))].sort();
  for (const [id, name] of [["f-task", "task"], ["f-dtype", "dtype"]]) {
    for (const v of values(name)) $(id).append(el("option", { value: v, textContent: v }));
  }
  for (const note of data.notes) $("notes").append(el("li", { textContent: note }));

  const draw = () => {
    const task = $("f-task").value, dtype = $("f-dtype").value, changed = $("f-changed").checked;
    const body = document.querySelector("#pairs tbody");
    const rows = items.filter((it) => (!task || it.task === task) && (!dtype || it.dtype === dtype) &&
      (!changed || it.ar_score !== it.orthrus_score));
    body.replaceChildren(...rows.map((it) => {
      const tr = el("tr");
      tr.dataset.key = it.key;
      for (const [v, cls] of [[it.task], [it.dtype], [it.mode], [it.doc_id, "num"], [it.ar_score, "num"],
        [it.orthrus_score, "num"], [firstDifference(it.ar, it.orthrus), "num"]]) {
        tr.append(el("td", { textContent: String(v), className: cls || "" }));
      }
      tr.addEventListener("click", () => { location.hash = encodeURIComponent(it.key); });
      return tr;
    }));
    $("count").value = `${rows.length} of ${items.length} items`;
  };

  const open = () => {
    const raw = location.hash.slice(1);
    if (!raw || raw === "overview" || raw === "items") return;
    let key;
    try { key = decodeURIComponent(raw); } catch (e) { key = raw; }
    const panel = $("pair");
    const i = byKey.get(key);
    if (i === undefined) {
      panel.replaceChildren(el("p", { textContent: `No item with key ${key} in this report.` }));
    } else {
      const it = items[i];
      const at = firstDifference(it.ar, it.orthrus);
      panel.replaceChildren(
        el("h2", { textContent: key }),
        el("p", { className: "meta", textContent: `${it.task} · ${it.dtype} · ${it.mode} · item ${it.doc_id} · ` +
          `score AR ${it.ar_score}, Orthrus ${it.orthrus_score} · responses part at character ${at}` }),
        el("h3", { textContent: "Prompt" }), el("div", { className: "prompt", textContent: it.prompt }),
        el("h3", { textContent: "Target" }), el("div", { className: "prompt", textContent: it.target }),
        el("div", { className: "side" },
          el("span", { className: "label", textContent: "AR" }), parted(it.ar, at),
          el("span", { className: "label", textContent: "Orthrus" }), parted(it.orthrus, at)));
    }
    panel.hidden = false;
    panel.scrollIntoView({ block: "start" });
  };

  for (const id of ["f-task", "f-dtype", "f-changed"]) $(id).addEventListener("input", draw);
  window.addEventListener("hashchange", open);
  draw();
  open();
  $("status").textContent = `${items.length} items differ`;
  document.body.dataset.ready = "1";
}

unpack($("data").textContent).then(render).catch((err) => {
  $("status").textContent = `this page could not read its data: ${err}`;
  console.error(err);
});
