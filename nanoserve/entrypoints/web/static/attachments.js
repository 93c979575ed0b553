// Images attached to the next message: picked with the image button or pasted into the message
// box, shown as thumbnails above it until sent, read as data: URLs (the server takes no other
// kind from the page: nothing is uploaded elsewhere). The button shows only when the model takes
// images, as Ollama's POST /api/show says ("vision" among its capabilities).

import { apiFetch, el } from "./common.js";

const $ = (id) => document.getElementById(id);
const attached = []; // data: URLs, in the order they were added
let isAccepted = false;
let numChecks = 0; // a model picked while an earlier check is in flight: its answer wins

/** Wire the button, the file input and paste on `input`; `onError(text)` shows a failure. */
export function wireAttachments(input, onError) {
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", async () => {
    await attach([...$("image-file").files], onError);
    $("image-file").value = ""; // the same file picked again fires `change` again
  });
  input.addEventListener("paste", (event) => {
    const files = [...event.clipboardData?.files ?? []].filter(isImage);
    if (!isAccepted || !files.length) return;
    // an image alone on the clipboard would otherwise paste nothing, or a file's name
    if (!event.clipboardData.types.includes("text/plain")) event.preventDefault();
    attach(files, onError);
  });
}

/** Ask the server whether `model` takes images; show or hide the button (hidden on failure). */
export async function checkImages(model) {
  const check = ++numChecks;
  let isVision = false;
  try {
    const response = await apiFetch("/api/show", { method: "POST",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model }) });
    isVision = response.ok && ((await response.json()).capabilities ?? []).includes("vision");
  } catch {
    // unreachable or not Ollama-shaped: offer no images rather than a button that fails
  }
  if (check !== numChecks) return;
  isAccepted = isVision;
  $("attach").hidden = !isVision;
  if (!isVision) attached.length = 0;
  renderAttached();
}

export const hasAttached = () => attached.length > 0;

/** The attached images, handed over for the message being sent (and cleared here). */
export function takeAttached() {
  const images = attached.splice(0);
  renderAttached();
  return images;
}

/** A user message's content as the API takes it: its text, or its text and image parts. */
export function userContent(message) {
  if (!message.images?.length) return message.content;
  const parts = message.content ? [{ type: "text", text: message.content }] : [];
  for (const url of message.images) parts.push({ type: "image_url", image_url: { url } });
  return parts;
}

/** A user turn's images as small thumbnails (null when it has none). */
export function imageStrip(images) {
  const shown = (images ?? []).filter(isDataImage); // the page's own storage, checked anyway
  if (!shown.length) return null;
  return el("div", { class: "images" }, ...shown.map((url, i) =>
    el("img", { src: url, class: "thumb", alt: `image ${i + 1}` })));
}

async function attach(files, onError) {
  for (const file of files.filter(isImage)) {
    try {
      attached.push(await dataUrl(file));
    } catch {
      onError(`The image ${file.name || ""} could not be read.`);
    }
  }
  renderAttached();
}

function renderAttached() {
  $("attachments").hidden = !attached.length;
  $("attachments").replaceChildren(...attached.map((url, i) => {
    const remove = el("button", { type: "button", class: "remove icon",
      "aria-label": `Remove image ${i + 1}` }, "\u00d7");
    remove.addEventListener("click", () => {
      attached.splice(i, 1);
      renderAttached();
    });
    return el("figure", { class: "attachment" },
      el("img", { src: url, class: "thumb", alt: `attached image ${i + 1}` }), remove);
  }));
}

function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => (isDataImage(reader.result) ? resolve(reader.result) : reject());
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

const isImage = (file) => file.type.startsWith("image/");
const isDataImage = (url) => typeof url === "string" && url.startsWith("data:image/");
