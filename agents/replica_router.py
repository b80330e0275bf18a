"""The policy client's router over inference replicas (``inference.replicas: N``): one server per GPU, one client.

Every request the client sends goes to one replica, chosen so:

- a request made inside a rollout (``agents.client.rollout_context``) goes where that rollout's first request went,
  so the turns of a multi-turn rollout find their shared prefix in one server's KV cache;
- any other request, and a rollout's first, goes to the live replica with the fewest requests outstanding (ties: the
  lower index), which spreads a GRPO step's rollouts evenly and keeps a slow replica from piling up work;
- a replica that cannot be reached (connection refused or dropped: the server died) is taken out of this client and
  the request is sent again to another one (a rollout sticky to it moves with it); when none is left the last error
  is raised. A timeout or an HTTP error status is the server's answer and is returned as it is.

Replicas are addressed by rewriting the request URL's base (``<replica>/v1/...``), so the OpenAI client above sees
one endpoint. A replica taken out stays out for this client's life; the flow makes a new client per task, which tries
every replica again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

# Failures that mean the replica itself is gone; the request never produced an answer, so sending it again is safe.
REPLICA_GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class ReplicaRouter(httpx.AsyncBaseTransport):
    """Send each request to one of `base_urls` (each ``http://host:port/v1``-like) by the rule above; `rollout()`
    gives the rollout in progress (an object with a ``replica`` attribute) or None."""

    def __init__(self, base_urls: list[str], inner: httpx.AsyncBaseTransport | None = None,
                 rollout: Callable[[], Any] = lambda: None):
        if not base_urls:
            raise ValueError("ReplicaRouter needs at least one replica URL")
        self.replicas = [httpx.URL(u.rstrip("/")) for u in base_urls]
        self._inner = inner or httpx.AsyncHTTPTransport()
        self.outstanding = [0] * len(self.replicas)
        self.sent = [0] * len(self.replicas)  # requests each replica answered (any status)
        self.alive = [True] * len(self.replicas)
        self._rollout = rollout

    def pick(self) -> int:
        """The replica for a request: the rollout's own while it is alive, else the least loaded live one."""
        ctx = self._rollout()
        chosen = getattr(ctx, "replica", None)
        if chosen is None or not self.alive[chosen]:
            live = [i for i, ok in enumerate(self.alive) if ok]
            if not live:
                raise httpx.ConnectError("every inference replica is out (none could be reached)")
            chosen = min(live, key=lambda i: (self.outstanding[i], i))
            if ctx is not None:
                ctx.replica = chosen
        return chosen

    def _url_on(self, replica: int, url: httpx.URL) -> httpx.URL:
        """`url` (addressed to replica 0, the client's base URL) moved onto `replica`."""
        base, target = self.replicas[0], self.replicas[replica]
        path = url.path
        if base.path and path.startswith(base.path):
            path = path[len(base.path):]
        return url.copy_with(scheme=target.scheme, host=target.host, port=target.port,
                             path=target.path.rstrip("/") + path)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        content = await request.aread()  # sent again if a replica is gone
        while True:
            replica = self.pick()
            headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "host"]
            routed = httpx.Request(request.method, self._url_on(replica, request.url), headers=headers,
                                   content=content, extensions=request.extensions)
            self.outstanding[replica] += 1
            try:
                response = await self._inner.handle_async_request(routed)
            except REPLICA_GONE:
                self.alive[replica] = False
                if not any(self.alive):
                    raise
                continue
            finally:
                self.outstanding[replica] -= 1
            self.sent[replica] += 1
            return response

    async def aclose(self) -> None:
        await self._inner.aclose()
