// Preloaded into the Portkey gateway (`node -r portkey-fetch-wrapper.cjs ...`) by `make bench`.
//
// Portkey 1.15.2 on Node 20 fails every streamed response with `TypeError: immutable`
// (Portkey issues #1389 and #1550): it sets headers on the Response that undici's fetch
// returns, whose headers are immutable. Re-wrapping each response in a new Response with a
// fresh Headers object makes them mutable; the body stream is passed through untouched, so
// streaming stays streaming.
"use strict";
const originalFetch = globalThis.fetch;
globalThis.fetch = async function wrappedFetch(...args) {
  const r = await originalFetch(...args);
  return new Response(r.body, {
    status: r.status,
    statusText: r.statusText,
    headers: new Headers(r.headers),
  });
};
