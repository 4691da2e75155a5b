// The chat page: streams /v1/chat/completions with fetch and renders tokens as they arrive (a thinking model's
// thought apart, above its answer).
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  $("transcript").appendChild(div);
  return div;
}

// A reply's thought, shown where the model thinks (reasoning_content): open while it streams, folded once the
// answer begins. Only the answer joins the conversation, as chat templates drop past thoughts.
function showThought(reply, thought, answering) {
  let details = reply.querySelector(".thought");
  if (!details) {
    details = Object.assign(document.createElement("details"), { className: "thought", open: true });
    details.append(Object.assign(document.createElement("summary"), { textContent: "thought" }));
    details.append(document.createElement("div"));
    reply.prepend(details);
  }
  details.lastChild.textContent = thought;
  if (answering) details.open = false;
}

// The model picker: every model that generates, by name (the first is the server's default); its state on hover.
async function loadModels() {
  const picker = $("model");
  const option = (text, value, title) => Object.assign(document.createElement("option"), { text, value, title });
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    const chat = r.ok ? body.data.filter((m) => m.task !== "embed") : [];
    picker.replaceChildren(...(r.ok ? chat.map((m) => option(m.id, m.id, m.state)) : [option(body.error.message, "")]));
  } catch (e) {
    picker.replaceChildren(option("server unreachable", ""));
  }
  picker.disabled = picker.options.length < 2;
}

// Yields {event, data} for each Server-Sent Event of a fetch response body.
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
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

// Re-open a cut stream after the last event seen, retrying while the network is down.
async function reconnect(streamId, lastId) {
  for (let attempt = 1; attempt <= 10; attempt++) {
    await new Promise((resolve) => setTimeout(resolve, 150 * attempt));
    try {
      const r = await fetch(`/v1/streams/${streamId}?last_event_id=${lastId}`, { headers: headers(), signal: controller.signal });
      if (r.ok) return r;
      throw new Error(`${r.status}: the stream can no longer be resumed`);
    } catch (e) {
      if (!(e instanceof TypeError)) throw e;
    }
  }
  throw new Error("connection lost");
}

async function send(prompt) {
  history.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const out = addMessage("assistant", "");
  const answer = out.appendChild(Object.assign(document.createElement("span"), { className: "answer" }));
  out.classList.add("streaming");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating…");
  let text = "", thought = "", finished = null;
  try {
    let response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: controller.signal,
      body: JSON.stringify({
        model: $("model").value || undefined,
        messages: history,
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: Number($("max_tokens").value),
        temperature: Number($("temperature").value),
        top_p: Number($("top_p").value),
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({ error: { message: response.statusText } }));
      throw new Error(`${response.status}: ${body.error.message}`);
    }
    // A cut connection resumes the same generation from the last event seen.
    const streamId = response.headers.get("X-Stream-Id");
    let lastId = 0;
    for (;;) {
      try {
        for await (const { event, id, data } of sseEvents(response)) {
          if (id) lastId = Number(id);
          if (event === "error") {
            out.classList.add("interrupted");
            throw new Error(`interrupted: ${JSON.parse(data).error.message}`);
          }
          if (data === "[DONE]") break;
          const chunk = JSON.parse(data);
          for (const choice of chunk.choices) {
            text += choice.delta.content || "";
            thought += choice.delta.reasoning_content || "";
            if (choice.finish_reason) finished = choice.finish_reason;
          }
          if (chunk.usage) setStatus(`${chunk.usage.completion_tokens} tokens, finish: ${finished}`);
          if (thought) showThought(out, thought, text.length > 0);
          answer.textContent = text;
        }
        break;
      } catch (e) {
        if (!(e instanceof TypeError) || !streamId) throw e;  // a TypeError is a network failure
        setStatus("connection lost, resuming…");
        response = await reconnect(streamId, lastId);
        setStatus("generating…");
      }
    }
    if (finished === null) throw new Error("the stream ended without finishing");
    history.push({ role: "assistant", content: text });
  } catch (e) {
    if (e.name === "AbortError") setStatus("stopped");
    else setStatus(e.message, true);
    history.pop();
  } finally {
    out.classList.remove("streaming");
    $("send").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = $("prompt").value.trim();
  if (prompt) {
    $("prompt").value = "";
    send(prompt);
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("api_key").addEventListener("change", loadModels);  // a server with keys lists its models only to one
loadModels();
