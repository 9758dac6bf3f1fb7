"""Bounded load against engine pods, straight at their pod IPs (no kube-proxy here).

`Load` keeps `concurrency` requests in flight per target until stopped or `max_seconds`
pass, re-reading the target list so new pods join in. It counts answers by HTTP status
so the shedding scenario can see 429s for the shed class and 200s for the others. With
`stream=True` each request streams, and a 200 counts only once the stream has ended with
`[DONE]`: a stream cut midway counts as `CUT`, a connection that fails as 0.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx


CUT = "cut"  # a streamed 200 that ended before `data: [DONE]`


@dataclass
class Load:
    targets: Callable[[], list[str]]  # base URLs, e.g. http://127.77.0.3:8000
    concurrency: int = 4
    max_tokens: int = 64
    priority_class: str | None = None
    max_seconds: float = 180.0
    stream: bool = False
    statuses: Counter = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "Load":
        for i in range(self.concurrency):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"load-{i}")
            t.start()
            self._threads.append(t)
        return self

    def _worker(self, index: int) -> None:
        deadline = time.monotonic() + self.max_seconds
        models: dict[str, str] = {}
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set() and time.monotonic() < deadline:
                urls = self.targets()
                if not urls:
                    time.sleep(0.2)
                    continue
                url = urls[index % len(urls)]
                try:
                    if url not in models:
                        models[url] = http.get(f"{url}/v1/models").json()["data"][0]["id"]
                    body = {"model": models[url], "prompt": "load " * 8, "max_tokens": self.max_tokens,
                            "ignore_eos": True}
                    if self.priority_class:
                        body["priority_class"] = self.priority_class
                    status = self._send(http, url, body)
                except httpx.HTTPError:
                    status = 0
                    time.sleep(0.2)
                with self._lock:
                    self.statuses[status] += 1
                if status == 429:
                    time.sleep(0.05)

    def _send(self, http: httpx.Client, url: str, body: dict) -> int | str:
        if not self.stream:
            return http.post(f"{url}/v1/completions", json=body).status_code
        with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                return resp.status_code
            last = ""
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    last = line
            return 200 if last == "data: [DONE]" else CUT

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=70)
