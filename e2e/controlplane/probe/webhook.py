#!/usr/bin/env python3
"""A minimal mutating admission webhook for webhook-probe.sh.

    webhook.py HOST PORT CERT KEY

Answers every AdmissionReview with allowed=true and a JSON patch that sets the
annotation probe.tailwarden.io/via=<last path segment>, so the caller can see
which webhook configuration (url:, Service, ...) reached it."""
import base64, json, ssl, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        via = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        obj = review["request"]["object"]
        ops = []
        if not obj.get("metadata", {}).get("annotations"):
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
        ops.append({"op": "add", "path": "/metadata/annotations/probe.tailwarden.io~1via", "value": via})
        body = json.dumps({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": review["request"]["uid"],
                "allowed": True,
                "patchType": "JSONPatch",
                "patch": base64.b64encode(json.dumps(ops).encode()).decode(),
            },
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        print(f"admitted {obj.get('kind')} {obj['metadata'].get('name')} via {via}", flush=True)

    def log_message(self, fmt, *args):
        pass


def main():
    host, port, cert, key = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.sni_callback = lambda _sock, name, _ctx: print(f"TLS handshake, SNI={name}", flush=True)
    srv = ThreadingHTTPServer((host, port), Handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    print(f"listening on https://{host}:{port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
