// The chat page of `dejavuu-build serve` (docs/serving.md). No dependencies, no build step.
// Safety: every text from the model or the user is inserted with textContent / text nodes, never
// as HTML; requests go to this page's own origin only (relative URLs; the server's
// Content-Security-Policy allows nothing else).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const MAX_IMAGE_BYTES = 24 << 20; // base64 grows it by a third: the server takes 32 MiB bodies

  let info = null;
  let history = []; // [{role, content}] sent with each request
  let image = null; // a data: URL
  let busy = null; // the AbortController of the request in flight

  // ------------------------------------------------------------------ streaming one request
  // POST /v1/chat/completions with stream: true; calls onPiece(spans, steps) for each chunk's
  // `dejavuu` extension and returns {text, usage, ext, seconds, firstAt, lastAt}.
  async function streamChat(body, onPiece, signal) {
    const t0 = performance.now();
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
      signal,
    });
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try {
        msg = (await r.json()).error.message;
      } catch (_) {
        /* not JSON: keep the status */
      }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    const out = { text: "", usage: null, ext: null, seconds: 0, firstAt: null, lastAt: null };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const msg = JSON.parse(data);
          if (msg.error) throw new Error(msg.error.message);
          if (msg.usage) {
            out.usage = msg.usage;
            out.ext = msg.dejavuu || null;
            continue;
          }
          const ext = msg.dejavuu;
          const delta = (msg.choices && msg.choices[0] && msg.choices[0].delta) || {};
          const spans = ext ? ext.spans : delta.content ? [{ text: delta.content, source: "model" }] : [];
          if (spans.length) {
            const now = performance.now();
            if (out.firstAt === null) out.firstAt = now;
            out.lastAt = now;
            for (const s of spans) out.text += s.text;
          }
          onPiece(spans, ext ? ext.steps : []);
        }
      }
    }
    out.seconds = (performance.now() - t0) / 1000;
    return out;
  }

  // ------------------------------------------------------------------ rendering (text only)
  function appendSpans(el, spans) {
    const root = document.scrollingElement;
    const follow = root.scrollTop + window.innerHeight >= root.scrollHeight - 40; // reader is at the end
    for (const s of spans) {
      if (s.source === "draft") {
        const span = document.createElement("span");
        span.className = "draft";
        span.textContent = s.text;
        el.appendChild(span);
      } else {
        el.appendChild(document.createTextNode(s.text));
      }
    }
    if (follow && spans.length) window.scrollTo(0, root.scrollHeight);
  }

  function bubble(role, label) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    const who = document.createElement("p");
    who.className = "who";
    who.textContent = label;
    const text = document.createElement("div");
    text.className = "text";
    div.append(who, text);
    $("log").appendChild(div);
    return { div, text };
  }

  // live counters for one reply, shown in #stats
  function counter() {
    const c = { tokens: 0, steps: 0, drafted: 0, accepted: 0, stepTokens: 0, t0: null, t1: null };
    c.add = (steps) => {
      for (const s of steps) {
        c.steps += 1;
        c.drafted += s.drafted;
        c.accepted += s.accepted;
        c.stepTokens += s.tokens;
      }
    };
    c.line = () => {
      const secs = c.t0 !== null && c.t1 > c.t0 ? (c.t1 - c.t0) / 1000 : 0;
      const rate = secs > 0 ? (c.stepTokens / secs).toFixed(1) : "–";
      const perStep = c.steps ? (c.stepTokens / c.steps).toFixed(2) : "–";
      const acc = c.drafted ? `${Math.round((100 * c.accepted) / c.drafted)}%` : "–";
      return (
        `${rate} tok/s · ${perStep} tokens per step (plain decoding: 1) · ` +
        `acceptance ${acc} (${c.accepted} of ${c.drafted} drafted tokens) · ${c.steps} steps`
      );
    };
    return c;
  }

  // ------------------------------------------------------------------ settings
  function settings() {
    const num = (id) => {
      const v = $(id).value.trim();
      return v === "" ? null : Number(v);
    };
    const body = {
      model: info.model,
      method: $("method").value,
      tree: $("tree").checked,
      temperature: num("temperature") ?? 0,
      top_p: num("top-p") ?? 1,
      max_tokens: num("max-tokens") ?? info.max_tokens,
    };
    const seed = num("seed");
    if (seed !== null) body.seed = seed;
    return body;
  }

  function userMessage() {
    const text = $("prompt").value;
    if (!text.trim() && !image) return null;
    if (!image) return { role: "user", content: text };
    return {
      role: "user",
      content: [
        { type: "text", text },
        { type: "image_url", image_url: { url: image } },
      ],
    };
  }

  function showUser(msg) {
    const b = bubble("user", "You");
    const parts = typeof msg.content === "string" ? [{ type: "text", text: msg.content }] : msg.content;
    for (const p of parts) {
      if (p.type === "text") b.text.appendChild(document.createTextNode(p.text));
      else {
        const img = document.createElement("img");
        img.src = p.image_url.url; // a data: URL the user chose
        img.alt = "An image you attached";
        img.className = "thumb";
        b.text.appendChild(img);
      }
    }
  }

  function setBusy(on) {
    $("send").disabled = on;
    $("compare").disabled = on;
    $("stop").disabled = !on;
    $("log").setAttribute("aria-busy", on ? "true" : "false");
  }

  function fail(e) {
    if (e.name === "AbortError") $("error").textContent = "Stopped.";
    else $("error").textContent = `Error: ${e.message}`;
  }

  // ------------------------------------------------------------------ actions
  async function send() {
    const msg = userMessage();
    if (!msg || busy) return;
    $("error").textContent = "";
    const body = settings();
    showUser(msg);
    const messages = [...history, msg];
    const reply = bubble("assistant", `Assistant (${body.method}${body.tree ? ", tree" : ""})`);
    reply.div.setAttribute("aria-busy", "true");
    const c = counter();
    busy = new AbortController();
    setBusy(true);
    $("stats").textContent = "Waiting for the first token…";
    try {
      const res = await streamChat(
        { ...body, messages },
        (spans, steps) => {
          const now = performance.now();
          if (c.t0 === null && spans.length) c.t0 = now;
          c.t1 = now;
          c.add(steps);
          appendSpans(reply.text, spans);
          $("stats").textContent = c.line();
        },
        busy.signal,
      );
      history = [...messages, { role: "assistant", content: res.text }];
      $("prompt").value = "";
      clearImage();
      $("stats").textContent = c.line() + (res.ext ? ` · ${res.seconds.toFixed(2)} s in all` : "");
      reply.div.dataset.done = "true";
    } catch (e) {
      fail(e);
    } finally {
      reply.div.setAttribute("aria-busy", "false");
      busy = null;
      setBusy(false);
      $("prompt").focus();
    }
  }

  async function compare() {
    const msg = userMessage();
    if (!msg || busy) return;
    $("error").textContent = "";
    const body = settings();
    if (body.seed === undefined) body.seed = Math.floor(Math.random() * 2 ** 31); // one seed for both
    const messages = [...history, msg];
    const panel = $("compare-panel");
    panel.hidden = false;
    panel.dataset.done = "false";
    $("cmp-method-name").textContent = body.method + (body.tree ? " (tree)" : "");
    $("cmp-method-h").textContent = `Speculative: ${body.method}${body.tree ? " (tree)" : ""}`;
    $("cmp-verdict").textContent = "Running plain decoding first, then the chosen method…";
    // each run drafts from a drafter memory of its own, empty: the chosen method must not draft
    // from the plain run's answer (nor from earlier chats), or the timing would flatter it
    const key = `page-compare-${Math.random().toString(36).slice(2)}`;
    const cols = [
      [$("cmp-plain"), { ...body, method: "baseline", tree: false, memory_key: `${key}-plain` }],
      [$("cmp-method"), { ...body, memory_key: `${key}-method` }],
    ];
    for (const [col] of cols) {
      col.querySelector("[data-role=text]").textContent = "";
      col.querySelector("[data-role=time]").textContent = "waiting…";
    }
    busy = new AbortController();
    setBusy(true);
    const results = [];
    try {
      for (const [col, b] of cols) {
        const text = col.querySelector("[data-role=text]");
        const c = counter();
        const res = await streamChat(
          { ...b, messages },
          (spans, steps) => {
            const now = performance.now();
            if (c.t0 === null && spans.length) c.t0 = now;
            c.t1 = now;
            c.add(steps);
            appendSpans(text, spans);
          },
          busy.signal,
        );
        const steps = res.ext ? res.ext.steps : c.steps;
        col.querySelector("[data-role=time]").textContent =
          `${res.seconds.toFixed(2)} s · ${steps} steps · ${c.line().split(" · ")[0]}`;
        results.push(res);
      }
      const [plain, spec] = results;
      const same = plain.text === spec.text;
      const speedup = spec.seconds > 0 ? plain.seconds / spec.seconds : 0;
      $("cmp-verdict").textContent =
        (same ? "Identical texts ✓" : "The texts differ ✗") +
        ` · plain ${plain.seconds.toFixed(2)} s, ${body.method} ${spec.seconds.toFixed(2)} s` +
        (speedup ? ` (${speedup.toFixed(2)}×)` : "");
      panel.dataset.identical = same ? "true" : "false";
      panel.dataset.done = "true";
    } catch (e) {
      fail(e);
      $("cmp-verdict").textContent = "The comparison did not finish.";
    } finally {
      busy = null;
      setBusy(false);
    }
  }

  function clearImage() {
    image = null;
    $("image").value = "";
    $("image-preview").hidden = true;
    $("image-preview").removeAttribute("src");
    $("image-remove").hidden = true;
  }

  function attach(file) {
    if (!file) return clearImage();
    if (!file.type.startsWith("image/")) {
      $("error").textContent = "Error: that file is not an image.";
      return clearImage();
    }
    if (file.size > MAX_IMAGE_BYTES) {
      $("error").textContent = `Error: the image is larger than ${MAX_IMAGE_BYTES >> 20} MiB.`;
      return clearImage();
    }
    const reader = new FileReader();
    reader.onload = () => {
      image = String(reader.result); // data:image/...;base64,...
      $("image-preview").src = image;
      $("image-preview").hidden = false;
      $("image-remove").hidden = false;
    };
    reader.onerror = () => {
      $("error").textContent = "Error: the image could not be read.";
    };
    reader.readAsDataURL(file);
  }

  // ------------------------------------------------------------------ start
  async function start() {
    try {
      const r = await fetch("/info");
      info = await r.json();
    } catch (e) {
      $("error").textContent = `Error: the server did not answer (${e.message}).`;
      return;
    }
    $("model-name").textContent = info.model;
    document.title = `${info.model} · dejavuu-build`;
    const select = $("method");
    for (const m of info.methods) {
      const opt = document.createElement("option");
      opt.value = m;
      opt.textContent = m === "baseline" ? "baseline (plain decoding)" : m;
      select.appendChild(opt);
    }
    select.value = info.method;
    $("tree").checked = info.tree;
    $("tree").disabled = !info.tree_capable;
    if (!info.tree_capable) $("tree").parentElement.title = "this build verifies chains only";
    $("image-row").hidden = !info.vision;
    $("max-tokens").value = String(Math.min(128, info.max_tokens));
    document.body.dataset.ready = "true";
  }

  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && busy) busy.abort();
  });
  $("compare").addEventListener("click", compare);
  $("stop").addEventListener("click", () => busy && busy.abort());
  $("clear").addEventListener("click", () => {
    if (busy) busy.abort();
    history = [];
    $("log").replaceChildren();
    $("stats").textContent = "No reply yet.";
    $("compare-panel").hidden = true;
    $("prompt").focus();
  });
  $("image").addEventListener("change", () => attach($("image").files[0]));
  $("image-remove").addEventListener("click", () => {
    clearImage();
    $("image").focus();
  });
  start();
})();
