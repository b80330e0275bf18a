"""`trajflow backend serve`: a LocalBackend behind HTTP, so scripts on a laptop train on a GPU box.

Training requests arrive as JSON (models, trajectory groups with their token ids and logprobs);
inference goes straight to the backend's embedded server in the dialect (its URL is returned by
``register``). With a key set, every route but ``/health`` (the API, ``/docs``, ``/openapi.json``) needs
``Authorization: Bearer <key>``; the command refuses to listen beyond loopback without one (backends/art/cli.py).

Answers: 400 for bad settings, names or groups (422 for a body of the wrong shape), 401 without the key, 404 for a
model not registered, 409 while another request writes the run or another process holds its lease, 500 with the
cause for the rest.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.model import TrainableModel, TrainConfig
from agents.trajectory import TrajectoryGroup
from backends.art.errors import NotRegisteredError, RunBusyError
from backends.art.local_backend import LocalBackend
from storage.lease import RunLeaseHeldError, RunLeaseLostError

OPEN_PATHS = frozenset({"/health"})


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str = Field(description="project of the run")
    name: str = Field(description="model (run) name")


class TrainRequest(ModelRef):
    groups: list[dict[str, Any]] = Field(description="trajectory groups as JSON (TrajectoryGroup.to_json_dict)")
    config: TrainConfig = Field(default_factory=TrainConfig, description="per-step training options")


class LogRequest(ModelRef):
    groups: list[dict[str, Any]] = Field(default_factory=list, description="trajectory groups as JSON")
    split: str = Field(default="val", description="metric prefix and file name, e.g. val")
    metrics: dict[str, float] = Field(default_factory=dict, description="metrics to store (a name without '/' "
                                      "goes under <split>/)")
    step: int | None = Field(default=None, ge=0, description="committed step to store them at; None: the latest")


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: TrainableModel = Field(description="the model to start from the source's step")
    from_model: str = Field(description="run to fork")
    from_project: str = Field(description="its project")
    from_storage: str | None = Field(default=None, description="its storage root; None: the backend's")
    not_after_step: int | None = Field(default=None, ge=0, description="latest checkpointed step at or before this")


class RetentionRequest(ModelRef):
    best_checkpoint_metric: str = Field(default="val/reward", description="metric whose best step is kept")


def bearer_matches(header: str, api_key: str) -> bool:
    """True when `header` is ``Bearer <api_key>`` (the scheme case-insensitive, as RFC 7235 has it), compared in
    constant time; a bare key or another scheme is refused."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def error_message(exc: Exception) -> str:
    """The error as one line; pydantic's errors as ``invalid TrainerConfig: lora_rank: <why>; ...``."""
    if isinstance(exc, ValidationError):
        return f"invalid {exc.title}: " + "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
    return str(exc)


def create_backend_app(backend: LocalBackend, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="trajflow backend")
    models: dict[str, TrainableModel] = {}

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if (api_key is not None and request.url.path not in OPEN_PATHS
                and not bearer_matches(request.headers.get("authorization", ""), api_key)):
            return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                content={"detail": "missing or wrong API key: send Authorization: Bearer <key>"})
        return await call_next(request)

    def model_of(ref: ModelRef) -> TrainableModel:
        model = models.get(f"{ref.project}/{ref.name}")
        if model is None:
            raise HTTPException(status_code=404, detail=f"model {ref.project}/{ref.name} is not registered; "
                                                         f"registered: {sorted(models)}")
        return model

    def groups_of(raw: list[dict[str, Any]]) -> list[TrajectoryGroup]:
        try:
            return [TrajectoryGroup.model_validate(g) for g in raw]
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=f"invalid trajectory group: {exc}") from exc

    def answer(status: int):
        async def handler(_request: Request, exc: Exception):
            return JSONResponse(status_code=status, content={"detail": error_message(exc)})
        return handler

    app.add_exception_handler(ValueError, answer(400))
    app.add_exception_handler(NotRegisteredError, answer(404))
    for conflict in (RunBusyError, RunLeaseHeldError, RunLeaseLostError):
        app.add_exception_handler(conflict, answer(409))

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception):  # uvicorn logs the traceback; the client gets the cause
        return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}: {exc}"})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/backend/register")
    async def register(model: TrainableModel) -> dict[str, Any]:
        await backend.register(model)
        key = f"{model.project}/{model.name}"
        models[key] = model
        return {"inference_base_url": model.inference_base_url, "step": await backend.get_step(model),
                "run_url": backend.run_url(model)}

    @app.post("/backend/step")
    async def step(ref: ModelRef) -> dict[str, int]:
        return {"step": await backend.get_step(model_of(ref))}

    @app.post("/backend/train")
    async def train(req: TrainRequest) -> dict[str, Any]:
        result = await backend.train_with_config(model_of(req), groups_of(req.groups), req.config)
        return result.model_dump()

    @app.post("/backend/log")
    async def log_groups(req: LogRequest) -> dict[str, Any]:
        done = await backend.record_log(model_of(req), groups_of(req.groups), req.split, req.metrics, req.step)
        return done.model_dump()

    @app.post("/backend/fork")
    async def fork(req: ForkRequest) -> dict[str, int]:
        if req.from_storage not in (None, backend.storage):
            raise ValueError(f"this backend forks runs of its own storage only ({backend.storage}), not "
                             f"{req.from_storage!r}")
        model = models.get(f"{req.model.project}/{req.model.name}", req.model)
        step = await backend.fork_from(model, req.from_storage, req.from_project, req.from_model, req.not_after_step)
        return {"step": step}

    @app.post("/backend/delete_checkpoints")
    async def delete_checkpoints(req: RetentionRequest) -> dict[str, list[int]]:
        return {"pruned": await backend.delete_checkpoints(model_of(req), req.best_checkpoint_metric)}

    return app
