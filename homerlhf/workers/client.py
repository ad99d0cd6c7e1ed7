"""HTTP client of one worker: requests with retry, restart of a local worker that died.

A worker killed by a crash signal (SIGILL: a llama.cpp build for another CPU) is not restarted: the
client raises the one-line explanation of :func:`homerlhf.workers.process.signal_death` instead.

A request is re-sent whole after a restart and its answer is taken only from the one response that
completes, so every sample gets its result exactly once: none lost, none counted twice.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import httpx

from homerlhf.errors import UserError
from homerlhf.workers.process import WorkerProcess


class WorkerError(RuntimeError):
    """The worker refused a request (4xx) or failed for good; the message carries its reason."""


class WorkerClient:
    """Talks to a remote worker at ``url``, or owns a local ``process`` it starts and restarts."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 process: Optional[WorkerProcess] = None, timeout: float = 600.0,
                 max_restarts: int = 5, remote_retries: int = 3):
        if (url is None) == (process is None):
            raise ValueError("pass exactly one of url (remote worker) and process (local worker)")
        self.url = url.rstrip("/") if url else None
        self.token = process.token if process is not None else token  # a local worker's own, else the given one
        self.process = process
        self.max_restarts = max_restarts
        self.remote_retries = remote_retries
        self.restarts = 0
        self._generation = 0
        self._restart_lock = threading.Lock()
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        self._closed = False

    @property
    def where(self) -> str:
        return self.url or "(not started)"

    def start(self) -> dict:
        """Starts the local worker (if any) and returns its ``/health``."""
        if self.process is not None and not self.process.alive():
            self.url = self.process.start()
        return self.health()

    def health(self) -> dict:
        return self._request("GET", "/health", None)

    def post(self, path: str, body: dict) -> dict:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: Optional[dict]) -> dict:
        failures = 0
        while True:
            generation, url = self._generation, self.url
            if self._closed:
                raise WorkerError("the worker client is closed")
            try:
                response = self._http.request(method, f"{url}{path}", json=body)
            except httpx.TransportError as exc:
                failures += 1
                self._recover(generation, exc, failures)
                continue
            if response.status_code == 401:
                raise UserError(f"the worker at {url} rejected the token (401); give the token it was started with "
                                "(HOMERLHF_REF_TOKEN / HOMERLHF_REWARD_TOKEN or <role>.token_file)")
            if response.status_code >= 400:
                try:
                    detail = response.json().get("detail", response.text)
                except ValueError:
                    detail = response.text
                raise WorkerError(f"{method} {path} -> {response.status_code}: {detail}")
            return response.json()

    def _recover(self, generation: int, exc: Exception, failures: int) -> None:
        """After a transport error: restart a dead local worker once (whichever thread sees it first)."""
        if self.process is None:
            if failures > self.remote_retries:
                raise WorkerError(f"the worker at {self.url} is unreachable ({type(exc).__name__}: {exc})") from exc
            time.sleep(0.5 * failures)
            return
        with self._restart_lock:
            if self._generation != generation:
                return  # another thread restarted it meanwhile: just re-send
            if self.process.alive():
                # A live worker dropped the connection (overload, a restart in progress): retry a few times.
                if failures > self.remote_retries:
                    raise WorkerError(f"the {self.process.role} worker at {self.url} keeps failing ({type(exc).__name__}: {exc}); its last lines:\n{self.process.tail()}") from exc
                time.sleep(0.2 * failures)
                return
            death = self.process.death()
            if death is not None and not death.restartable:
                raise UserError(self.process.death_line(death), exit_code=1) from None  # it would crash again
            if self.restarts >= self.max_restarts:
                raise UserError(self._give_up_line(death), exit_code=1) from None
            self.restarts += 1
            self.url = self.process.start()
            self._generation += 1

    def _give_up_line(self, death) -> str:
        process = self.process
        times = f"the {process.role} worker died {self.restarts + 1} times; giving up"
        if death is None:
            return f"{times} (the last time with exit code {process.exit_code}); see its log: {process.log_path}"
        return f"{times}; the last time by {death.name} ({death.meaning}); {death.fix} (worker log: {process.log_path})"

    def close(self) -> None:
        """Closes connections and stops a local worker. Safe to call twice."""
        self._closed = True
        self._http.close()
        if self.process is not None:
            self.process.stop()


def sequences_body(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> dict:
    """The request body of ``/logprobs`` and ``/score``: plain ints (tensors and numpy ints made JSON-safe)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    return {"sequences": [{"prompt_ids": [int(t) for t in p], "response_ids": [int(t) for t in r]}
                          for p, r in zip(prompt_ids, response_ids)]}
