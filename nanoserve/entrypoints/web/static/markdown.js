// The model's answer as Markdown. Its text is untrusted (a prompt can make a model write
// anything), so three walls stand between it and the page:
//   1. marked renders Markdown, but any raw HTML in the text comes out as escaped text, and
//      images come out as links (an <img> would fetch from whatever host the text names);
//   2. DOMPurify removes whatever could still run: event handlers, `javascript:` URLs, <script>;
//   3. the page's Content-Security-Policy (web/router.py) runs no inline script and talks to no
//      other host, should both of the above fail.
// marked and DOMPurify are vendored (static/vendor/README.md): loaded as globals, before us.

import { el } from "./common.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

marked.use({
  gfm: true,
  breaks: true, // a chat answer's single newlines are meant as line breaks
  renderer: {
    html: (token) => escapeHtml(token.text ?? token.raw ?? ""),
    image: (token) => `<a href="${escapeHtml(token.href ?? "")}">${
      escapeHtml(token.text || token.href || "image")}</a>`,
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") { // links open elsewhere, without telling that host who sent them
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

const PURIFY = {
  USE_PROFILE: { html: true },
  FORBID_TAGS: ["img", "style", "form", "input", "button", "textarea", "select", "video",
    "audio", "source", "picture"],
  ADD_ATTR: ["target"],
};

/** Render `text` (Markdown) into `target`, sanitized, with a copy button on each code block. */
export function renderMarkdown(target, text) {
  target.innerHTML = DOMPurify.sanitize(marked.parse(text), PURIFY);
  for (const pre of target.querySelectorAll("pre")) {
    const button = el("button", { type: "button", class: "copy-code" }, "Copy");
    button.addEventListener("click", () => copyText(pre.querySelector("code") ?? pre, button));
    pre.prepend(button);
  }
}

/** Copy an element's text (or a string); the button says "Copied" for a moment. */
export async function copyText(source, button) {
  const text = typeof source === "string" ? source : source.textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API outside a secure context (plain http to another machine): select and
    // copy through a hidden text area instead
    const area = el("textarea", { class: "offscreen", "aria-hidden": "true" });
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = label; }, 1200);
}
