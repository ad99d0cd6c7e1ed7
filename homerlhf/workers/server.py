"""The llama.cpp worker: one process serving one model (reference or reward) over HTTP.

``POST /logprobs`` (ref role, with the actor's sampling ``temperature``, default 1) and
``POST /score`` (reward role) take token ids and answer with
:class:`~homerlhf.workers.engine.Engine`'s results; ``GET /health`` reports the model, its
vocabulary fingerprint and the served totals.

One lock guards the llama context: requests are served one at a time, a bad request is a 4xx and
never takes the worker down. ``--parent-pid`` makes the worker exit when its owner is gone, even
after ``kill -9`` of the owner.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from homerlhf.errors import UserError
from homerlhf.workers.engine import BadRequest, Engine

READY_PREFIX = "homerlhf worker ready"


class SequenceIds(BaseModel):
    """One sample: the prompt's token ids and the response's."""

    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[StrictInt]
    response_ids: list[StrictInt]


class SequencesRequest(BaseModel):
    """The body of ``POST /score``."""

    model_config = ConfigDict(extra="forbid")
    sequences: list[SequenceIds] = Field(min_length=1)


class LogprobsRequest(SequencesRequest):
    """The body of ``POST /logprobs``: the sequences and the temperature the actor sampled at."""

    temperature: float = Field(1.0, gt=0)


def check_bind(host: str, token: Optional[str]) -> None:
    """A worker computes for anyone who reaches it: off loopback it needs a token."""
    if token:
        return
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UserError(f"refusing to bind {host} without a token; set HOMERLHF_WORKER_TOKEN or pass --token-file "
                        "(a 0600 file; clients send it as a Bearer token), or bind 127.0.0.1")


# --------------------------------------------------------------------------- HTTP


def create_app(engine: Engine, token: Optional[str] = None):
    """The FastAPI app around ``engine``; with ``token`` every request needs ``Authorization: Bearer``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="homerlhf llama.cpp worker", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if token:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {token}".encode()):
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse({"detail": f"malformed request: {msg}"}, status_code=422)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        return JSONResponse({"detail": str(exc)}, status_code=400)

    def _pairs(body: SequencesRequest):
        return [(s.prompt_ids, s.response_ids) for s in body.sequences]

    @app.get("/health")
    def health():
        return engine.health()

    # Sync handlers run in FastAPI's thread pool; the lock makes the llama context single-user.
    @app.post("/logprobs")
    def logprobs(body: LogprobsRequest):
        with engine.lock:
            return {"logprobs": engine.logprobs(_pairs(body), body.temperature)}

    @app.post("/score")
    def score(body: SequencesRequest):
        with engine.lock:
            return {"scores": engine.score(_pairs(body))}

    return app


def watch_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Exit this process as soon as ``parent_pid`` is gone (or a zombie), checked every ``interval`` s."""
    import psutil

    try:
        parent = psutil.Process(parent_pid)
        created = parent.create_time()
    except psutil.NoSuchProcess:
        os._exit(0)

    def alive() -> bool:
        try:
            return parent.create_time() == created and parent.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def loop():
        while alive():
            time.sleep(interval)
        # The owner is gone: nobody will ever call us again. No cleanup can matter more than exiting.
        os._exit(0)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def serve(role: str, model: Path, host: str = "127.0.0.1", port: int = 0, threads: int = 0,
          ctx: int = 2048, token: Optional[str] = None, f32_kv_cache: bool = False,
          parent_pid: Optional[int] = None, batch_tokens: int = 0) -> None:
    """Load the model, bind, print the ready line (with the port) and serve until stopped."""
    import uvicorn

    check_bind(host, token)
    if parent_pid:
        watch_parent(parent_pid)
    engine = Engine(role, model, threads=threads, ctx=ctx, f32_kv_cache=f32_kv_cache, batch_tokens=batch_tokens)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise UserError(f"cannot bind {host}:{port} ({exc.strerror}); pick another --port (0: any free one)") from None
    # Listening before the ready line: a client that reads it can connect at once (the backlog holds it).
    sock.listen(128)
    bound_port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    print(f"{READY_PREFIX} role={role} port={bound_port} url=http://{url_host}:{bound_port} pid={os.getpid()}", flush=True)
    config = uvicorn.Config(create_app(engine, token), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
