"""A small in-process fake SGLang HTTP server that answers with SGLang's quoted shapes
(tests/rollout/sglang/shapes.py) and records every call: what the client tests run against."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.rollout.sglang import shapes


class FakeSglang:
    """SGLang's native routes on 127.0.0.1, answering with the quoted shapes (the adapter answers
    with the keys and words a real SGLang 0.5.23 sent, shapes.py "Recorded"); records
    (method, path, json body) of every call, every answer by path, and the peak number of
    concurrent /generate calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.answers: dict[str, list[tuple[int, object]]] = {}
        self.loaded: dict[str, str] = {}
        self.next_answer: dict[str, tuple[int, object]] = {}  # path -> answer for its next call only
        self.flush_refusals = 0  # /flush_cache calls still to refuse (requests "running")
        self.generate_delay_s = 0.0
        self.api_key: str | None = None  # SGLang's --api-key: every route but /health needs the Bearer key
        self.active = self.peak_active = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._serve()

            def do_POST(self) -> None:
                self._serve()

            def _serve(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if fake.api_key and self.path != "/health" and \
                        self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    status, answer = 401, {"error": "Unauthorized"}  # SGLang's add_api_key_middleware
                else:
                    status, answer = fake.handle(self.command, self.path, json.loads(raw) if raw else None)
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(answer, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.calls]

    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        answer = self._answer(method, path, body)
        with self._lock:
            self.answers.setdefault(path, []).append(answer)
        return answer

    def _answer(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        with self._lock:
            self.calls.append((method, path, body))
            if path in self.next_answer:
                return self.next_answer.pop(path)
        if path == "/generate":
            return self._generate(body)
        with self._lock:
            return self._control(path, body)

    def _generate(self, body: dict) -> tuple[int, object]:
        lora = body.get("lora_path")
        if lora is not None and lora not in self.loaded:
            return 400, {"error": {"message": f"Got LoRA adapter that has never been loaded: {lora}\n"
                                              f"All loaded adapters: dict_keys({list(self.loaded)})."}}
        with self._lock:
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
        time.sleep(self.generate_delay_s)
        with self._lock:
            self.active -= 1
        batch = isinstance(body["input_ids"][0], list)
        n = len(body["input_ids"]) if batch else body["sampling_params"].get("n", 1)
        if n == 1 and not batch:
            return 200, shapes.GENERATE_RESPONSE
        return 200, [shapes.GENERATE_RESPONSE_N2[i % 2] for i in range(n)]

    def _control(self, path: str, body: dict | None) -> tuple[int, object]:
        if path == "/health":
            return shapes.HEALTH_OK
        ids = {"rid": None, "http_worker_ipc": None}  # LoRAUpdateOutput's first keys, as recorded
        if path == "/load_lora_adapter":
            name = body["lora_name"]
            if name in self.loaded:
                return 400, {**ids, "success": False, "error_message": f"Failed to load LoRA adapter {name} because "
                             "it is already loaded", "loaded_adapters": dict(self.loaded)}
            self.loaded[name] = body["lora_path"]
            return 200, {**ids, "success": True, "error_message": "", "loaded_adapters": dict(self.loaded)}
        if path == "/unload_lora_adapter":
            name = body["lora_name"]
            if name not in self.loaded:
                return 400, {**ids, "success": False, "error_message": f"LoRA with name {name} does not exist. "
                             f"Loaded LoRAs: odict_keys({list(self.loaded)})", "loaded_adapters": None}
            del self.loaded[name]
            return 200, {**ids, "success": True, "error_message": "", "loaded_adapters": dict(self.loaded)}
        if path == "/update_weights_from_disk":
            return shapes.UPDATE_WEIGHTS_OK
        if path == "/flush_cache":
            if self.flush_refusals:
                self.flush_refusals -= 1
                return shapes.FLUSH_CACHE_REFUSED
            return shapes.FLUSH_CACHE_OK
        return 404, {"detail": "Not Found"}
