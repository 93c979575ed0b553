// What the chat page and the dashboard share: calls to the server with the API key, and the
// words for its errors. The key is asked for on a 401, kept in localStorage and sent as
// `Authorization: Bearer`; the pages themselves are public, the server's answers are not.

const KEY_ITEM = "nanoserve.apiKey";
let keyDialog = null;
let pendingKey = null; // one question at a time, whatever number of calls got a 401

/** fetch() with the stored key; on a 401 ask for a key and try again (until cancelled). */
export async function apiFetch(path, options = {}) {
  for (;;) {
    const key = localStorage.getItem(KEY_ITEM);
    const headers = new Headers(options.headers);
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const entered = await askForKey(key ? "The server did not accept this API key."
      : "This server needs an API key.");
    if (entered === null) return response;
    localStorage.setItem(KEY_ITEM, entered);
  }
}

/** The key the person types (null if they cancel); one dialog serves every waiting call. */
function askForKey(reason) {
  if (pendingKey) return pendingKey;
  keyDialog ??= buildKeyDialog();
  keyDialog.querySelector(".key-reason").textContent = reason;
  const input = keyDialog.querySelector("input");
  input.value = "";
  pendingKey = new Promise((resolve) => {
    keyDialog.onclose = () => {
      pendingKey = null;
      resolve(keyDialog.returnValue === "ok" && input.value ? input.value : null);
    };
  });
  keyDialog.returnValue = "";
  keyDialog.showModal();
  input.focus();
  return pendingKey;
}

function buildKeyDialog() {
  const input = el("input", { type: "password", name: "key", autocomplete: "off",
    "aria-label": "API key" });
  const cancel = el("button", { type: "button" }, "Cancel");
  const form = el("form", {},
    el("p", { class: "key-reason" }),
    el("label", {}, "API key ", input),
    el("p", { class: "hint" }, "Kept in this browser (localStorage) and sent with each call."),
    el("div", { class: "buttons" }, cancel, el("button", { type: "submit" }, "Use this key")));
  const dialog = el("dialog", { id: "key-dialog" }, form);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    dialog.close("ok");
  });
  cancel.addEventListener("click", () => dialog.close("cancel"));
  document.body.append(dialog);
  return dialog;
}

/** What to tell a person about a failed call, from its status and OpenAI-style error body. */
export async function errorText(response) {
  let message = "";
  try {
    message = (await response.json()).error?.message ?? "";
  } catch {
    // not JSON: the status says enough
  }
  if (response.status === 401) return "This server needs an API key (none was accepted).";
  if (response.status === 429) {
    return "The server is busy (too many requests in flight); try again in a moment.";
  }
  if (response.status === 400) return message || "The server refused the request.";
  return `HTTP ${response.status}${message ? `: ${message}` : ""}`;
}

/** An element with attributes and children (strings become text, never HTML). */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}
