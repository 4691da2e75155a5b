// The chat page: streams /v1/chat/completions with fetch and renders tokens as they arrive (a thinking model's
// thought apart, above its answer). The conversation, and a reply in flight, outlive a reload (sessionStorage):
// the reply resumes after its last event (GET /v1/streams/<id>). Stop cancels the generation (DELETE).
"use strict";

const $ = (id) => document.getElementById(id);
const SAVED = "wsgi-infer-chat";
const fresh = () => ({
  // X-Session-Id: nginx's several-host file keeps a conversation on one host, where its prefix is cached
  session: Math.random().toString(36).slice(2) + Date.now().toString(36),
  turns: [], // the conversation as the model is sent it: what the page shows
  pending: null, // the reply in flight: {streamId, lastId, text, thought, finished}
});
let state = JSON.parse(sessionStorage.getItem(SAVED) || "null") || fresh();
let controller = null;
let frame = null; // a reply's drawing, waiting for the next frame: one per frame, not one per event
// Nothing at all (the server's heartbeats included, every 5 s by default) for this long: a connection that died
// without closing (a lost network, a NAT's dropped mapping), taken as cut, and the reply resumed.
const STALL_MS = window.WSGI_INFER_STALL_MS || 20000;

const save = () => sessionStorage.setItem(SAVED, JSON.stringify(state));

function headers() {
  const h = { "Content-Type": "application/json", "X-Session-Id": state.session };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

// Keep the newest text in view, unless the reader has scrolled up to read.
function follow(update) {
  const atEnd = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
  update();
  if (atEnd) window.scrollTo(0, document.body.scrollHeight);
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  follow(() => $("transcript").appendChild(div));
  return div;
}

function addReply() {
  const out = addMessage("assistant", "");
  return { out, answer: out.appendChild(Object.assign(document.createElement("span"), { className: "answer" })) };
}

// A reply's thought, shown where the model thinks (reasoning_content): open while it streams, folded once the
// answer begins. Only the answer joins the conversation, as chat templates drop past thoughts.
function render(view, reply) {
  if (reply.thought) {
    let details = view.out.querySelector(".thought");
    if (!details) {
      details = Object.assign(document.createElement("details"), { className: "thought", open: true });
      details.append(Object.assign(document.createElement("summary"), { textContent: "thought" }));
      details.append(document.createElement("div"));
      view.out.prepend(details);
    }
    details.lastChild.textContent = reply.thought;
    if (reply.text) details.open = false;
  }
  view.answer.textContent = reply.text;
}

// The model picker: every model that generates, by name (the first is the server's default); its state on hover.
async function loadModels() {
  const picker = $("model");
  const chosen = picker.value;
  const option = (text, value, title) => Object.assign(document.createElement("option"), { text, value, title });
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    const chat = r.ok ? body.data.filter((m) => m.task !== "embed") : [];
    picker.replaceChildren(...(r.ok ? chat.map((m) => option(m.id, m.id, m.state)) : [option(body.error.message, "")]));
    if (chat.some((m) => m.id === chosen)) picker.value = chosen;
  } catch (e) {
    picker.replaceChildren(option("server unreachable", ""));
  }
  picker.disabled = picker.options.length < 2;
}

// The next chunk of a body; a TypeError (a network failure's kind) once it stalls STALL_MS.
function readOrStall(reader) {
  let timer;
  const stalled = new Promise((_, reject) => {
    timer = setTimeout(() => {
      reject(new TypeError("the connection stalled")); // first: the cancel ends the read as if the body had ended
      reader.cancel().catch(() => {});
    }, STALL_MS);
  });
  return Promise.race([reader.read(), stalled]).finally(() => clearTimeout(timer));
}

// Yields {event, id, data} for each Server-Sent Event of a fetch response body (lines end in LF, CRLF or CR).
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await readOrStall(reader);
    if (done) return;
    buffer = (buffer + value).replace(/\r\n|\r(?!$)/g, "\n"); // a CR last may be a CRLF's half
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message", id = null, data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("id:")) id = line.slice(3).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, id, data: data.join("\n") };
    }
  }
}

async function httpError(response) {
  const body = await response.json().catch(() => ({ error: { message: response.statusText } }));
  return new Error(`${response.status}: ${body.error.message}`);
}

// Re-open a cut stream after the last event seen, retrying while the network, or the server behind a proxy
// (its 502, 503 or 504), is down.
async function reconnect(streamId, lastId) {
  for (let attempt = 1; attempt <= 10; attempt++) {
    await new Promise((resolve) => setTimeout(resolve, 150 * attempt));
    try {
      const r = await fetch(`/v1/streams/${streamId}?last_event_id=${lastId}`, { headers: headers(), signal: controller.signal });
      if (r.ok) return r;
      if (![502, 503, 504].includes(r.status)) throw await httpError(r); // the server's reason (a key missing...)
    } catch (e) {
      if (!(e instanceof TypeError)) throw e;
    }
  }
  throw new Error("connection lost");
}

// Read a reply's events into ``reply`` (saved as they come), resuming the stream where the connection drops.
async function read(response, view, reply) {
  for (;;) {
    try {
      for await (const { event, id, data } of sseEvents(response)) {
        if (id) reply.lastId = Number(id);
        if (event === "error") throw new Error(`interrupted: ${JSON.parse(data).error.message}`);
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        for (const choice of chunk.choices) {
          reply.text += choice.delta.content || "";
          reply.thought += choice.delta.reasoning_content || "";
          if (choice.finish_reason) reply.finished = choice.finish_reason;
        }
        if (chunk.usage) setStatus(`${chunk.usage.completion_tokens} tokens, finish: ${reply.finished}`);
        frame = frame || requestAnimationFrame(() => draw(view, reply));
      }
      break;
    } catch (e) {
      if (!(e instanceof TypeError) || !reply.streamId) throw e; // a TypeError is a network failure
      setStatus("connection lost, resuming…");
      response = await reconnect(reply.streamId, reply.lastId);
      setStatus("generating…");
    }
  }
  if (!reply.finished) throw new Error("the stream ended without finishing");
}

// Show the reply as it stands, and save it (both cost its whole length: once a frame, not once an event).
function draw(view, reply) {
  cancelAnimationFrame(frame);
  frame = null;
  follow(() => render(view, reply));
  save();
}

function begin(view) {
  view.out.classList.add("streaming");
  $("transcript").setAttribute("aria-busy", "true"); // a screen reader reads the reply once, not each token
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating…");
  $("prompt").focus(); // not lost with the Send button it was on
}

// The reply ends: finished, stopped or failed. Its text so far joins the conversation, as the page shows it; a
// reply stopped or failed before any text is taken back, and its question returns to the composer.
function end(view, reply, error) {
  draw(view, reply);
  view.out.classList.remove("streaming");
  $("transcript").setAttribute("aria-busy", "false");
  $("send").disabled = false;
  $("stop").disabled = true;
  controller = null;
  if (reply !== state.pending) return; // a new chat began meanwhile
  if (error && error.name === "AbortError") setStatus("stopped");
  else if (error) setStatus(error.message, true);
  else if (!$("status").textContent.includes("finish")) setStatus(`finish: ${reply.finished}`); // no usage came
  if (!error || reply.text) {
    if (error) view.out.classList.add(error.name === "AbortError" ? "stopped" : "interrupted");
    state.turns.push({ role: "assistant", content: reply.text });
  } else {
    const asked = state.turns.pop();
    view.out.previousElementSibling.remove();
    view.out.remove();
    if (!$("prompt").value) $("prompt").value = asked.content;
  }
  state.pending = null;
  save();
}

function requestBody() {
  const number = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value)); // empty: the server's
  return {
    model: $("model").value || undefined,
    messages: state.turns,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: number("max_tokens"),
    temperature: number("temperature"),
    top_p: number("top_p"),
  };
}

async function send(prompt) {
  state.turns.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const view = addReply();
  const reply = (state.pending = { streamId: null, lastId: 0, text: "", thought: "", finished: null });
  begin(view);
  try {
    const body = JSON.stringify(requestBody());
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), signal: controller.signal, body });
    if (!response.ok) throw await httpError(response);
    reply.streamId = response.headers.get("X-Stream-Id");
    save();
    await read(response, view, reply);
    end(view, reply, null);
  } catch (e) {
    end(view, reply, e);
  }
}

// After a reload: the conversation as it was, and the reply that was streaming resumed after its last event.
async function restore() {
  for (const turn of state.turns) {
    if (turn.role === "user") addMessage("user", turn.content);
    else render(addReply(), { text: turn.content, thought: "" });
  }
  const reply = state.pending;
  if (!reply) return;
  const view = addReply();
  render(view, reply);
  begin(view);
  try {
    if (!reply.streamId) throw new Error("the page was left before the reply began");
    await read(await reconnect(reply.streamId, reply.lastId), view, reply);
    end(view, reply, null);
  } catch (e) {
    end(view, reply, e);
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = $("prompt").value.trim();
  if (prompt && !controller) {
    $("prompt").value = "";
    send(prompt);
  }
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault(); // Enter sends, Shift+Enter starts a new line
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => {
  const streamId = state.pending && state.pending.streamId;
  if (streamId) fetch(`/v1/streams/${streamId}`, { method: "DELETE", headers: headers() }).catch(() => {});
  if (controller) controller.abort();
});
$("new_chat").addEventListener("click", () => {
  if (controller) $("stop").click();
  state = fresh();
  save();
  $("transcript").replaceChildren();
  setStatus("");
});
$("api_key").addEventListener("change", loadModels); // a server with keys lists its models only to one
loadModels().then(restore);
