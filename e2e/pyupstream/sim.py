#!/usr/bin/env python3
"""A simulated OpenAI-compatible provider on aiohttp: the battery's upstream not built on hyper.

Self-hosted providers mostly run Python HTTP stacks (aiohttp, uvicorn), whose framing,
keep-alive and reset behaviour differ from hyper's; a proxy judged only against its own
hyper-based simulator can miss what they do. This server reads the same profile files as
`tailwarden-sim` (e2e/profiles/, the fields of e2e/src/sim/profile.rs) and computes the same
keyed fates (e2e/src/sim/fate.rs): attempt k of the request with `x-request-id: K` meets
the fate drawn from (seed, K, k), with attempts counted across every provider this process
serves. One process serves one port per --profile, so the providers of a topology share the
attempt ledger the way in-process `tailwarden-sim` servers share a `FateLedger`.

    sim.py --profile A.yaml --profile B.yaml --seed 7 [--host 127.0.0.1]
    sim.py --self-test

Prints `listening on HOST:PORT` once per profile, in order, then serves until killed.
`POST /sim/reset` restarts the clock (windows, account limits), the ledger and the counters;
`GET /sim/stats` returns {"chat_completions": N, "by_outcome": {...}}.
"""

import argparse
import asyncio
import json
import math
import sys
import time

import yaml
from aiohttp import web

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
Z99 = 2.3263
MAX_LATENCY_MS = 600_000.0
STALL_FOR_S = 600.0


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & MASK
    return h


class Draws:
    """The uniform numbers of one attempt, in the order fate.rs consumes them."""

    def __init__(self, seed, key, attempt):
        k = mix64((attempt * GOLDEN) & MASK)
        self.state = mix64((seed ^ mix64(fnv1a64(key.encode()) ^ k)) & MASK)

    def next_unit(self):
        self.state = (self.state + GOLDEN) & MASK
        z = mix64(self.state)
        return ((z >> 11) + 0.5) * (1.0 / 9007199254740992.0)


A = (-3.969683028665376e1, 2.209460984245205e2, -2.759285104469687e2,
     1.383577518672690e2, -3.066479806614716e1, 2.506628277459239e0)
B = (-5.447609879822406e1, 1.615858368580409e2, -1.556989798598866e2,
     6.680131188771972e1, -1.328068155288572e1)
C = (-7.784894002430293e-3, -3.223964580411365e-1, -2.400758277161838e0,
     -2.549732539343734e0, 4.374664141464968e0, 2.938163982698783e0)
D = (7.784695709041462e-3, 3.224671290700398e-1, 2.445134137142996e0,
     3.754408661907416e0)


def inv_norm_cdf(p):
    """Acklam's approximation, written operation for operation as in fate.rs."""
    def tail(q):
        return ((((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
                / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0))
    if p < 0.02425:
        return tail(math.sqrt(-2.0 * math.log(p)))
    if p <= 1.0 - 0.02425:
        q = p - 0.5
        r = q * q
        return ((((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
                / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0))
    return -tail(math.sqrt(-2.0 * math.log(1.0 - p)))


class ProfileError(Exception):
    pass


def _pick(d, names, where):
    for n in names:
        if n in d:
            return float(d[n])
    raise ProfileError(f"{where}: missing {names[0]}")


class Quantile:
    def __init__(self, spec, where):
        if not isinstance(spec, dict) or len(spec) != 1:
            raise ProfileError(f"{where}: expected exactly one of constant, uniform, lognormal")
        (kind, v), = spec.items()
        v = v or {}
        self.kind = kind
        if kind == "constant":
            self.value = _pick(v, ("ms", "value"), where)
        elif kind == "uniform":
            self.lo = _pick(v, ("minMs", "min"), where)
            self.hi = _pick(v, ("maxMs", "max"), where)
        elif kind == "lognormal":
            median = _pick(v, ("medianMs", "median"), where)
            p99 = _pick(v, ("p99Ms", "p99"), where)
            if median <= 0 or p99 < median:
                raise ProfileError(f"{where}: need 0 < medianMs <= p99Ms")
            self.mu = math.log(median)
            self.sigma = (math.log(p99) - math.log(median)) / Z99
        else:
            raise ProfileError(f"{where}: unknown distribution {kind}")

    def at(self, u):
        if self.kind == "constant":
            v = self.value
        elif self.kind == "uniform":
            v = self.lo + u * (self.hi - self.lo)
        else:
            v = math.exp(self.mu + self.sigma * inv_norm_cdf(u))
        return min(max(v, 0.0), MAX_LATENCY_MS)


PROFILE_FIELDS = {
    "ttft", "itl", "outputTokens", "error5xxPercent", "rateLimitPercent", "retryAfterSeconds",
    "resetPercent", "dropMidStreamPercent", "stallPercent", "brownouts", "outages",
    "accountLimit", "embeddingDims", "models",
}


def window_open(w, t):
    start = float(w["startS"])
    if t < start:
        return False
    since = t - start
    every = w.get("everyS")
    if every:
        return since % float(every) < float(w["durationS"])
    return since < float(w["durationS"])


class Profile:
    def __init__(self, path):
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        unknown = set(raw) - PROFILE_FIELDS
        if unknown:
            raise ProfileError(f"{path}: unknown field(s) {sorted(unknown)}")
        self.ttft = Quantile(raw.get("ttft", {"constant": {"ms": 0}}), f"{path}: ttft")
        self.itl = Quantile(raw.get("itl", {"constant": {"ms": 0}}), f"{path}: itl")
        self.tokens = Quantile(raw.get("outputTokens", {"constant": {"value": 16}}),
                               f"{path}: outputTokens")
        self.e5xx = float(raw.get("error5xxPercent", 0))
        self.rl = float(raw.get("rateLimitPercent", 0))
        self.retry_after = int(raw.get("retryAfterSeconds", 1))
        self.reset = float(raw.get("resetPercent", 0))
        self.drop = float(raw.get("dropMidStreamPercent", 0))
        self.stall = float(raw.get("stallPercent", 0))
        self.brownouts = raw.get("brownouts", []) or []
        self.outages = raw.get("outages", []) or []
        self.account = raw.get("accountLimit")
        self.models = raw.get("models", ["gpt-4.1", "gpt-4.1-mini", "text-embedding-3-small"])

    def conditions(self, t):
        mult, err, rl, storm_ra = 1.0, 0.0, 0.0, None
        for b in self.brownouts:
            if window_open(b, t):
                mult *= float(b.get("latencyMultiplier", 1.0))
                err = max(err, float(b.get("errorPercent", 0.0)))
                rl = max(rl, float(b.get("rateLimitPercent", 0.0)))
                if storm_ra is None and b.get("retryAfterSeconds") is not None:
                    storm_ra = int(b["retryAfterSeconds"])
        down = any(window_open(o, t) for o in self.outages)
        return mult, err, rl, storm_ra, down

    def fault_at(self, u):
        edge = self.e5xx
        if u < edge:
            return "500" if u < edge / 2.0 else "503"
        for p, fault in ((self.rl, "429"), (self.reset, "reset"), (self.drop, "drop"),
                         (self.stall, "stall")):
            edge += p
            if u < edge:
                return fault
        return "none"

    def fate(self, seed, key, attempt, t, cap):
        """Exactly fate.rs's Fate::draw: the same numbers in the same order."""
        d = Draws(seed, key, attempt)
        u_window = d.next_unit() * 100.0
        u_fault = d.next_unit() * 100.0
        u_ttft = d.next_unit()
        u_tokens = d.next_unit()
        u_cut = d.next_unit()
        mult, err, rl, storm_ra, down = self.conditions(t)
        retry_after = self.retry_after
        if down:
            fault = "reset"
        elif u_window < err:
            fault = "503"
        elif u_window < err + rl:
            fault = "429"
            if storm_ra is not None:
                retry_after = storm_ra
        else:
            fault = self.fault_at(u_fault)
        wanted = max(round_half_away(self.tokens.at(u_tokens)), 1)
        capped = cap is not None and wanted > max(cap, 1)
        tokens = max(cap, 1) if capped else wanted
        ttft = self.ttft.at(u_ttft) * mult
        gaps = [self.itl.at(d.next_unit()) * mult for _ in range(1, tokens)]
        drop_after = 1 + min(int(u_cut * (tokens - 1)), tokens - 2) if tokens >= 2 else 1
        return {"fault": fault, "retry_after": retry_after, "ttft": ttft, "tokens": tokens,
                "capped": capped, "gaps": gaps, "drop_after": drop_after}


def round_half_away(x):
    """Rust's f64::round (halves away from zero), unlike Python's banker's round()."""
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


WORDS = ("Hello", " there", "!", " How", " can", " I", " help", " you", " today", "?")


class Group:
    """The providers of one topology: one clock, one attempt ledger."""

    def __init__(self, seed):
        self.seed = seed
        self.reset()

    def reset(self):
        self.epoch = time.monotonic()
        self.ledger = {}
        for p in getattr(self, "providers", []):
            p.reset()

    def attempt(self, key):
        n = self.ledger.get(key, 0) + 1
        self.ledger[key] = n
        return n


class Provider:
    def __init__(self, group, profile):
        self.group = group
        self.profile = profile
        self.reset()

    def reset(self):
        self.chat = 0
        self.outcomes = {}
        self.window = (-1, 0)
        self.counter = 0

    def count(self, outcome):
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def meter(self, t):
        acct = self.profile.account
        if not acct:
            return None
        limit, win = int(acct["requests"]), float(acct["windowS"])
        index = math.floor(t / win)
        reset = max((index + 1) * win - t, 0.0)
        if self.window[0] != index:
            self.window = (index, 0)
        used = self.window[1]
        if used >= limit:
            return (limit, 0, reset, False)
        self.window = (index, used + 1)
        return (limit, limit - used - 1, reset, True)


def reset_text(secs):
    ms = int(secs * 1000)
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return ("%.3f" % secs).rstrip("0").rstrip(".") + "s"
    return f"{ms // 60000}m{(ms % 60000) // 1000}s"


def error_body(message, kind, code=None):
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


def chunk(cid, created, model, delta, finish=None):
    return ("data: " + json.dumps({
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }, separators=(",", ":")) + "\n\n").encode()


async def sleep_until(loop, due):
    delay = due - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


def make_app(provider):
    group = provider.group
    profile = provider.profile

    async def chat(request):
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        provider.chat += 1
        key = request.headers.get("x-request-id")
        if not key:
            provider.counter += 1
            key = f"anon-{provider.counter}"
        attempt = group.attempt(key)
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            provider.count("bad_request")
            return web.Response(status=400, content_type="application/json",
                                text=error_body(f"We could not parse the JSON body of your request: {e}",
                                                "invalid_request_error"))
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            provider.count("bad_request")
            return web.Response(status=400, content_type="application/json",
                                text=error_body("Missing required parameter: 'messages'.",
                                                "invalid_request_error", "missing_required_parameter"))
        t = time.monotonic() - group.epoch
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        fate = profile.fate(group.seed, key, attempt, t, int(cap) if cap else None)
        headers = {"x-sim-attempt": str(attempt)}
        metered = provider.meter(t)
        if metered is not None:
            limit, remaining, reset, admitted = metered
            headers.update({"x-ratelimit-limit-requests": str(limit),
                            "x-ratelimit-remaining-requests": str(remaining),
                            "x-ratelimit-reset-requests": reset_text(reset)})
            if not admitted:
                provider.count("fault_429")
                headers["Retry-After"] = str(max(math.ceil(reset), 1))
                return web.Response(status=429, content_type="application/json", headers=headers,
                                    text=error_body("Rate limit reached for requests per window on this account. Please try again after the reset.",
                                                    "requests", "rate_limit_exceeded"))
        fault = fate["fault"]
        if fault in ("500", "503"):
            provider.count("fault_" + fault)
            msg = ("The server had an error while processing your request. Sorry about that!"
                   if fault == "500" else "The engine is currently overloaded, please try again later.")
            return web.Response(status=int(fault), content_type="application/json",
                                headers=headers, text=error_body(msg, "server_error"))
        if fault == "429":
            provider.count("fault_429")
            headers["Retry-After"] = str(fate["retry_after"])
            return web.Response(status=429, content_type="application/json", headers=headers,
                                text=error_body("Rate limit reached for requests. Please try again later.",
                                                "requests", "rate_limit_exceeded"))
        if fault == "reset":
            provider.count("fault_reset")
            request.transport.abort()
            raise asyncio.CancelledError()
        model = str(body.get("model", ""))
        cid = f"chatcmpl-py{provider.chat:012x}"
        created = int(time.time())
        tokens = fate["tokens"]
        finish = "length" if fate["capped"] else "stop"
        if not body.get("stream"):
            if fault == "stall":
                provider.count("fault_stall")
                await asyncio.sleep(STALL_FOR_S)
            due = arrived + fate["ttft"] / 1000.0 + sum(fate["gaps"]) / 1000.0
            await sleep_until(loop, due)
            text = "".join(WORDS[i % len(WORDS)] for i in range(tokens))
            provider.count("ok")
            return web.json_response({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
            }, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if fault == "stall":
            provider.count("fault_stall")
            await asyncio.sleep(STALL_FOR_S)
            request.transport.abort()
            return resp
        due = arrived + fate["ttft"] / 1000.0
        cut = fate["drop_after"] if fault == "drop" else None
        for i in range(tokens):
            if i > 0:
                due += fate["gaps"][i - 1] / 1000.0
            if cut is not None and i == cut:
                # Let the frames already written reach the client, then cut the connection.
                await asyncio.sleep(0.002)
                provider.count("fault_drop")
                request.transport.abort()
                return resp
            await sleep_until(loop, due)
            delta = {"role": "assistant", "content": WORDS[i % len(WORDS)]} if i == 0 else \
                {"content": WORDS[i % len(WORDS)]}
            await resp.write(chunk(cid, created, model, delta))
        opts = body.get("stream_options") or {}
        await resp.write(chunk(cid, created, model, {}, finish))
        if opts.get("include_usage"):
            await resp.write(("data: " + json.dumps({
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                         "total_tokens": tokens + 1}}) + "\n\n").encode())
        await resp.write(b"data: [DONE]\n\n")
        provider.count("ok")
        await resp.write_eof()
        return resp

    async def models(_request):
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "sim"} for m in profile.models]})

    async def healthz(_request):
        return web.Response(text="ok\n")

    async def stats(_request):
        return web.json_response({"chat_completions": provider.chat, "by_outcome": provider.outcomes})

    async def reset(_request):
        group.reset()
        return web.json_response({})

    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/sim/stats", stats)
    app.router.add_post("/sim/reset", reset)
    return app


def self_test():
    """The vectors of fate.rs's portable_vectors test."""
    assert fnv1a64(b"req-1") == 0xFDDBEEF2B6CE4891, hex(fnv1a64(b"req-1"))
    assert mix64(1) == 0x5692161D100B05E5, hex(mix64(1))
    d = Draws(7, "req-1", 1)
    got = [d.next_unit() for _ in range(3)]
    want = [0.9251218731694844, 0.23789585286879084, 0.5061742956788029]
    assert all(abs(a - b) < 1e-15 for a, b in zip(got, want)), got
    assert abs(inv_norm_cdf(0.99) - 2.326347874) < 1e-8
    print("self-test ok")


async def serve(args):
    group = Group(args.seed)
    group.providers = [Provider(group, Profile(p)) for p in args.profile]
    runners = []
    for provider in group.providers:
        runner = web.AppRunner(make_app(provider), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, args.host, 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        print(f"listening on {args.host}:{port}", flush=True)
    group.reset()
    await asyncio.Event().wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="append", default=[], help="profile YAML (one per provider)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return 0
    if not args.profile:
        parser.error("give at least one --profile")
    try:
        asyncio.run(serve(args))
    except ProfileError as e:
        print(f"sim.py: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
