"""RemoteBackend: the Backend protocol over HTTP, to a `trajflow backend serve` process (e.g. on a GPU box).

Training calls go to the backend's ``/backend/*`` endpoints; rollouts talk to its inference server
directly in the dialect. Experiment tracking runs here, in the script's process, with its credentials
(backends/art/backend_api.py); the server never tracks. If the backend reports its inference URL on a loopback or wildcard host, the
host this client used to reach the backend is substituted, so a client elsewhere gets a reachable URL.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from agents.model import Model, TrainableModel, TrainConfig, TrainResult
from agents.trajectory import TrajectoryGroup
from backends.art.backend_api import BackendAPI, LogResult
from backends.art.run_line import print_registered


class RemoteBackendError(RuntimeError):
    """The backend answered with an error (``status``: its HTTP status, None when unreachable); the message carries
    the status and the backend's detail (409: another request or process is writing the run)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteBackend(BackendAPI):
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 3600.0, track: bool = True):
        super().__init__(track=track)
        self.url = url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    async def _post(self, path: str, payload: dict[str, Any]) -> Any:
        try:
            resp = await self._http.post(path, json=payload)
        except httpx.HTTPError as exc:
            raise RemoteBackendError(f"backend {self.url} unreachable ({path}): {exc}") from exc
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail")
            except ValueError:
                detail = resp.text[:500]
            raise RemoteBackendError(f"backend {self.url}{path} answered {resp.status_code}: {detail}", resp.status_code)
        return resp.json()

    def _reachable(self, inference_url: str) -> str:
        inner, outer = urlsplit(inference_url), urlsplit(self.url)
        if inner.hostname in ("127.0.0.1", "localhost", "0.0.0.0", "::") and inner.hostname != outer.hostname:
            netloc = f"{outer.hostname}:{inner.port}" if inner.port else outer.hostname
            return urlunsplit((inner.scheme, netloc, inner.path, inner.query, inner.fragment))
        return inference_url

    @staticmethod
    def _ref(model: Model) -> dict[str, str]:
        return {"project": model.project, "name": model.name}

    async def _register(self, model: Model) -> str | None:
        if not isinstance(model, TrainableModel):
            return None
        data = await self._post("/backend/register", model.model_dump(mode="json"))
        model.inference_base_url = self._reachable(data["inference_base_url"])
        model.inference_api_key = self.api_key
        print_registered(f"{model.project}/{model.name}", f"{data.get('run_url', '?')} (backend {self.url})", int(data["step"]))
        return data.get("run_url") or f"{self.url}/{model.project}/{model.name}"

    async def get_step(self, model: TrainableModel) -> int:
        return int((await self._post("/backend/step", self._ref(model)))["step"])

    async def _train(self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig) -> TrainResult:
        payload = {**self._ref(model), "groups": [g.to_json_dict() for g in groups],
                   "config": config.model_dump(mode="json", exclude_none=True)}
        return TrainResult.model_validate(await self._post("/backend/train", payload))

    async def record_log(self, model: Model, groups: list[TrajectoryGroup], split: str,
                         metrics: dict[str, float] | None = None, step: int | None = None) -> LogResult:
        payload = {**self._ref(model), "groups": [g.to_json_dict() for g in groups], "split": split,
                   "metrics": metrics or {}, "step": step}
        return LogResult.model_validate(await self._post("/backend/log", payload))

    async def fork_from(self, model: TrainableModel, from_storage: str | None, from_project: str, from_model: str,
                    not_after_step: int | None) -> int:
        payload = {"model": model.model_dump(mode="json"), "from_storage": from_storage,
                   "from_project": from_project, "from_model": from_model, "not_after_step": not_after_step}
        return int((await self._post("/backend/fork", payload))["step"])

    async def delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str = "val/reward") -> list[int]:
        payload = {**self._ref(model), "best_checkpoint_metric": best_checkpoint_metric}
        return (await self._post("/backend/delete_checkpoints", payload))["pruned"]

    async def close(self) -> None:
        self.close_trackers()
        await self._http.aclose()
