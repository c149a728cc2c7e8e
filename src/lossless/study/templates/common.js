// Shared by the pages' scripts: the page's data (gzip + base64 JSON, unpacked by the browser's own
// DecompressionStream) and a small element builder.
"use strict";

const $ = (id) => document.getElementById(id);

async function unpack(text) {
  const bytes = Uint8Array.from(atob(text.trim()), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props || {});
  for (const child of children) node.append(child);
  return node;
}
