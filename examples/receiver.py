#!/usr/bin/env python3
"""A receiver for trying the shop examples on one machine: answers 200 to every POST and
prints its path, its Idempotency-Key header and its body, one line per request.

Usage: receiver.py [PORT]   (default 8099; listens on 127.0.0.1)
"""
import http.server
import sys


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
        key = self.headers.get("Idempotency-Key", "-")
        print(f"{self.path} {key} {body.decode('utf-8', 'replace')}", flush=True)

    def log_message(self, format, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8099
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Receiver).serve_forever()
