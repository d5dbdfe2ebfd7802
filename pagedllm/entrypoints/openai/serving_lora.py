"""LoRA adapters served as models: loaded at start (--lora-modules) or at run time by vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (under /v1, so --api-key guards them); a request names one by
`model`, and /v1/models lists them with the base model as parent."""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import APIError, engine_errors
from pagedllm.lora_request import LoRARequest

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModules:
    """The adapters the server serves, by name; each gets a new id (ids are never reused, so a name loaded again
    never finds the K/V that its earlier weights computed in the prefix cache)."""

    def __init__(self, base_names: list[str]) -> None:
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self.pending: set[str] = set()  # names being loaded
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name is not None else None

    async def load(self, engine: EngineClient, name: str, path: str) -> LoRARequest:
        """Read and register an adapter (off the event loop); 400 if the name is taken or the adapter cannot serve."""
        if not name or name in self.base_names or name in self.by_name or name in self.pending:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        request = LoRARequest(name, next(self._ids), path)
        self.pending.add(name)
        try:
            with engine_errors():
                await engine.add_lora(request)
        finally:
            self.pending.discard(name)
        self.by_name[name] = request
        return request

    async def unload(self, engine: EngineClient, name: str) -> None:
        """Forget an adapter: 404 if unknown, 400 while a request uses it."""
        request = self.by_name.get(name)
        if request is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        with engine_errors():
            await engine.remove_lora(request.lora_int_id)
        self.by_name.pop(name, None)


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules name=path ... as (name, path) pairs."""
    pairs = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {value!r}")
        pairs.append((name, path))
    return pairs


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request) -> Response:
    ctx = raw.app.state.server
    await ctx.loras.load(ctx.engine, req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request) -> Response:
    ctx = raw.app.state.server
    await ctx.loras.unload(ctx.engine, req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
