"""The routes that generate nothing: /v1/models (the base model's names and the LoRA adapters), /health, /metrics,
/version, /tokenize, /detokenize (vLLM's).
/tokenize and /detokenize are open without --api-key (and with it unless --api-key-utility-routes)."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm import __version__
from pagedllm.entrypoints.openai.errors import APIError, engine_errors, json_response
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving import server_of
from pagedllm.entrypoints.openai.serving_chat import chat_renderer

router = APIRouter()


@router.get("/v1/models")
async def list_models(raw: Request) -> Response:
    ctx = server_of(raw)
    cards = [ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
             for name in ctx.model_names]
    cards += [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=ctx.model_names[0],
                        max_model_len=ctx.max_model_len) for lora in ctx.loras.by_name.values()]
    return json_response(ModelList(data=cards))


@router.get("/health")
async def health(raw: Request) -> Response:
    """200 while the engine serves (over replicas: while one does; the body then lists each replica); 503 while it
    restarts after a failure, or for good once it is dead."""
    engine = server_of(raw).engine
    if not engine.is_alive:
        with engine_errors():
            engine.check_alive()  # raises the reason
    replicas = engine.replica_health()
    if replicas is not None:
        return JSONResponse({"status": "ok", "replicas": replicas})
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(generate_latest(server_of(raw).stats.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request) -> Response:
    """Open without --api-key (as vLLM's): all its tokenizer work runs in the utility pool, whose queue is bounded
    (503 past it), so a flood of these cannot delay the generating routes' tokenization."""
    ctx = server_of(raw)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if req.messages is not None:
        work = chat_renderer(ctx, req.messages, req.add_generation_prompt)
    else:
        ctx.check_prompt_chars(req.prompt, "prompt")
        work = functools.partial(ctx.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    ids = await ctx.utility_workers.run(work)
    return json_response(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids))


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request) -> Response:
    """Open like /tokenize, and run in the same bounded pool."""
    ctx = server_of(raw)
    ctx.check_model(req.model)
    vocab = ctx.engine.vocab_size
    if len(req.tokens) > ctx.max_model_len:
        raise APIError(400, f"at most max_model_len ({ctx.max_model_len}) tokens", param="tokens")
    if not all(0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    text = await ctx.utility_workers.run(ctx.tokenizer.decode, req.tokens)
    return json_response(DetokenizeResponse(prompt=text))
