"""The e2e journey's workload: an app that calls a model through the real OpenAI Python SDK,
configured only by the environment the injected pod gives it (OPENAI_BASE_URL points at the
sidecar on loopback). It logs one JSON line per event on stdout, with its own clock, so the
test can read from `kubectl logs` what the app saw:

  {"t": 1764581234.5, "event": "request", "ok": true, "provider": "sim-a", "ms": 3.1}
  {"t": ..., "event": "stream", "id": 7, "ok": true, "chunks": 40, "finish": "stop", "ms": 4012}
  {"t": ..., "event": "sigterm", "in_flight": 8}     # the stream running when SIGTERM came
  {"t": ..., "event": "exit", "requests": 431, "failed": 0}

Short chat completions run every APP_INTERVAL_MS on the main thread; streams of
APP_STREAM_TOKENS tokens run back to back on a second thread, so one is nearly always in
flight. On SIGTERM the app starts nothing new, lets the stream in flight finish, and exits.
"""

import json
import os
import signal
import sys
import threading
import time

import openai

MODEL = os.environ.get("APP_MODEL", "gpt-4.1")
INTERVAL = float(os.environ.get("APP_INTERVAL_MS", "200")) / 1000
STREAM_TOKENS = int(os.environ.get("APP_STREAM_TOKENS", "40"))

stop = threading.Event()
lock = threading.Lock()
state = {"in_flight": None, "requests": 0, "failed": 0, "streams": 0}


def log(event, **fields):
    line = json.dumps({"t": time.time(), "event": event, **fields})
    with lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def on_sigterm(_signum, _frame):
    log("sigterm", in_flight=state["in_flight"])
    stop.set()


def error_fields(e):
    return {"ok": False, "error": type(e).__name__, "status": getattr(e, "status_code", None), "detail": str(e)[:200]}


def request(client):
    start = time.monotonic()
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "ping"}]
        )
        completion = raw.parse()
        fields = {
            "ok": bool(completion.choices),
            "provider": raw.headers.get("x-tailwarden-provider"),
            "status": raw.status_code,
        }
    except Exception as e:  # every failure is what the test counts
        fields = error_fields(e)
    state["requests"] += 1
    if not fields["ok"]:
        state["failed"] += 1
    log("request", ms=round((time.monotonic() - start) * 1000, 1), **fields)


def streams(client):
    n = 0
    while not stop.is_set():
        n += 1
        state["in_flight"] = n
        start = time.monotonic()
        chunks, finish = 0, None
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                max_tokens=STREAM_TOKENS,
                stream=True,
                messages=[{"role": "user", "content": "tell a long story"}],
            )
            for chunk in stream:
                if chunk.choices:
                    if chunk.choices[0].delta.content:
                        chunks += 1  # content chunks: one per token from the simulator
                    finish = chunk.choices[0].finish_reason or finish
            fields = {"ok": finish is not None, "chunks": chunks, "finish": finish}
        except Exception as e:
            fields = {**error_fields(e), "chunks": chunks}
        state["in_flight"] = None
        state["streams"] += 1
        if not fields["ok"]:
            state["failed"] += 1
        log("stream", id=n, ms=round((time.monotonic() - start) * 1000, 1), **fields)
        if not fields["ok"]:
            stop.wait(INTERVAL)  # no tight loop against a sidecar that is not there


def main():
    signal.signal(signal.SIGTERM, on_sigterm)
    client = openai.OpenAI(max_retries=0, timeout=60)
    log("start", base_url=str(client.base_url), model=MODEL)
    streamer = threading.Thread(target=streams, args=(client,), daemon=True)
    streamer.start()
    while not stop.is_set():
        request(client)
        stop.wait(INTERVAL)
    streamer.join()
    log("exit", requests=state["requests"], streams=state["streams"], failed=state["failed"])


if __name__ == "__main__":
    main()
