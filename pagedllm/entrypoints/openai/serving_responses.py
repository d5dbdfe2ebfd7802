"""/v1/responses, OpenAI's Responses API: input as text or items (messages, function calls and their outputs),
instructions, function tools, text formats, a response object or the Responses event stream; with `store`, the
response is kept (response_store.py) for `previous_response_id`, GET, DELETE, and, for a `background` one, cancel.
The request converts into one chat request and runs on the chat path (chat_path.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.chat_path import (
    ChatRun,
    OutputSplitter,
    chat_request,
    final_output,
    split_output,
    start_chat,
)
from pagedllm.entrypoints.openai.errors import APIError, json_response
from pagedllm.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutput,
    IncompleteDetails,
    InputText,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.serving import (
    ChoiceDelta,
    SSEResponse,
    cancel_all,
    client_of,
    collect,
    server_of,
    sse_event,
    stream_events,
)
from pagedllm.outputs import CompletionOutput

router = APIRouter()


def store_of(raw: Request) -> ResponseStore:
    return raw.app.state.responses


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request -> chat request -----------------------------------------------------------------------------
def text_of(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as chat messages: function calls join the assistant message before them (or make one), their
    outputs become tool messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return out


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise APIError(400, "text.format.schema: a json_schema format needs a schema", param="text")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}


def chat_fields(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    fields: dict[str, Any] = {
        "model": req.model, "messages": instructions + messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stream": req.stream,
        "response_format": response_format(req), "parallel_tool_calls": req.parallel_tool_calls, "user": req.user}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    return {k: v for k, v in fields.items() if v is not None}


def previous_messages(store: ResponseStore, previous_id: str | None) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    entry = store.get(previous_id)
    if entry is None:
        raise APIError(404, f"Previous response with id '{previous_id}' not found.", param="previous_response_id")
    if entry.response.status in ("queued", "in_progress"):
        raise APIError(400, f"Previous response '{previous_id}' is still in progress.", param="previous_response_id")
    return entry.messages


# ---- chat output -> response -----------------------------------------------------------------------------
def output_items(c: CompletionOutput, tools: frozenset[str]) -> list[OutputItem]:
    text, calls = split_output(c, tools)
    items: list[OutputItem] = [OutputMessage(id=item_id("msg"), content=[OutputText(text=text)])] \
        if text or not calls else []
    return items + [FunctionCallOutput(id=item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments)
                    for call in calls]


def assistant_message(items: list[OutputItem]) -> dict[str, Any]:
    """The output as the assistant message the next turn's conversation holds."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(
        part.text for item in items if isinstance(item, OutputMessage) for part in item.content)}
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in items if isinstance(i, FunctionCallOutput)]
    if calls:
        message["tool_calls"] = calls
    return message


class ResponseBuilder:
    """The response object of one run, in each state, and its entry in the store."""

    def __init__(self, req: ResponsesRequest, run: ChatRun, messages: list[dict[str, Any]],
                 store: ResponseStore) -> None:
        self.req, self.run, self.messages, self.store = req, run, messages, store
        self.template = ResponseObject(
            id=run.request_id, status="in_progress", model=run.model, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, previous_response_id=req.previous_response_id,
            temperature=req.temperature, top_p=req.top_p, parallel_tool_calls=req.parallel_tool_calls,
            tool_choice="auto" if req.tool_choice is None else req.tool_choice if isinstance(req.tool_choice, str)
            else req.tool_choice.model_dump(), tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text and req.text.format else {"format": {"type": "text"}},
            metadata=req.metadata or {}, store=req.store, background=req.background)

    def response(self, status: ResponseStatus, **fields: Any) -> ResponseObject:
        return self.template.model_copy(update={"status": status, **fields})

    def finish(self, c: CompletionOutput, items: list[OutputItem], completion_tokens: int) -> ResponseObject:
        """The final response (stored if asked): incomplete when it ran out of tokens, cancelled when aborted."""
        status: ResponseStatus = {"length": "incomplete", "abort": "cancelled"}.get(c.finish_reason or "", "completed")
        if status == "incomplete":
            for item in items:
                item.status = "incomplete"
        prompt_tokens = len(self.run.prompt)
        response = self.response(
            status, output=items, incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete" else None,
            usage=ResponseUsage(input_tokens=prompt_tokens, output_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens))
        self.keep(response, [*self.messages, assistant_message(items)])
        return response

    def keep(self, response: ResponseObject, messages: list[dict[str, Any]],
             task: asyncio.Task | None = None) -> None:
        if self.req.store:
            self.store.put(StoredResponse(response, messages, task))


# ---- the endpoints ---------------------------------------------------------------------------------------
@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, raw: Request) -> Response:
    ctx, store = server_of(raw), store_of(raw)
    if req.background and (req.stream or not req.store):
        raise APIError(400, "background responses need store=true and stream=false", param="background")
    messages = [*previous_messages(store, req.previous_response_id), *input_messages(req)]
    run = await start_chat(ctx, chat_request(chat_fields(req, messages)), "resp", client_of(raw))
    builder = ResponseBuilder(req, run, messages, store)
    if req.background:
        return json_response(start_background(builder))
    if req.stream:
        return SSEResponse(ResponseEvents(builder).events(), run.streams, ctx.stream_send_timeout)
    final = await final_output(raw, run)
    if isinstance(final, Response):
        return final
    return json_response(builder.finish(final, output_items(final, run.tools), len(final.token_ids)))


def start_background(builder: ResponseBuilder) -> ResponseObject:
    """Generate without the client: the response is stored queued, then completed (or cancelled, or failed)."""
    run = builder.run

    async def generate() -> None:
        try:
            c = (await collect(run.streams, 1))[0]
            builder.finish(c, output_items(c, run.tools), len(c.token_ids))
        except asyncio.CancelledError:
            builder.keep(builder.response("cancelled"), builder.messages)
        except APIError as e:
            builder.keep(builder.response("failed", error=ResponseError(
                code=e.info.code or e.info.type, message=e.info.message)), builder.messages)
        finally:
            cancel_all(run.streams)

    queued = builder.response("queued")
    builder.keep(queued, builder.messages, asyncio.create_task(generate()))
    return queued


def stored(store: ResponseStore, response_id: str) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return entry


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, raw: Request) -> Response:
    entry = stored(store_of(raw), response_id)
    response = entry.response
    if response.status == "queued" and entry.task is not None and not entry.task.done():
        response = response.model_copy(update={"status": "in_progress"})
    return json_response(response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request) -> Response:
    stored(store_of(raw), response_id)
    entry = store_of(raw).delete(response_id)
    if entry is not None and entry.task is not None:
        entry.task.cancel()
    return json_response(DeletedResponse(id=response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, raw: Request) -> Response:
    """Cancel a background response (OpenAI cancels only those); one that already finished is returned as is."""
    store = store_of(raw)
    entry = stored(store, response_id)
    if not entry.response.background:
        raise APIError(400, "Only background responses can be cancelled.", param="response_id")
    if entry.task is not None and not entry.task.done():
        entry.task.cancel()
        await asyncio.wait([entry.task])
    return json_response((store.get(response_id) or entry).response)


# ---- streaming -------------------------------------------------------------------------------------------
class ResponseEvents:
    """The Responses event stream of one run, in the order the official client checks: response.created and
    .in_progress; per output item, output_item.added, its content (a message's content_part.added, output_text
    deltas, output_text.done, content_part.done; a call's arguments delta and done), output_item.done; then
    response.completed (or .incomplete)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.splitter = OutputSplitter(builder.run.tools)
        self.seq = 0
        self.items: list[OutputItem] = []
        self.message: OutputMessage | None = None  # the message being written, at output index len(items)
        self.final: CompletionOutput | None = None

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse_event(kind, ResponseEvent(type=kind, sequence_number=self.seq - 1, **fields))

    def events(self) -> AsyncIterator[str]:
        started = self.builder.response("in_progress").model_dump()
        first = [self.event("response.created", response=started),
                 self.event("response.in_progress", response=started)]
        return stream_events(self.builder.run.streams, 1, False, self.on_delta, self.on_end, first=first, done=None)

    def on_delta(self, d: ChoiceDelta) -> str | None:
        if d.output.finish_reason is not None:
            self.final = d.output
        text, calls = self.splitter.update(d)
        out = [self.write_text(text)] if text else []
        for call in calls:
            out.append(self.close_message())
            item = FunctionCallOutput(id=item_id("fc"), call_id=call.id, name=call.name, arguments="",
                                      status="in_progress")
            where = {"item_id": item.id, "output_index": len(self.items)}
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=item.model_dump()))
            out.append(self.event("response.function_call_arguments.delta", **where, delta=call.arguments))
            out.append(self.event("response.function_call_arguments.done", **where, arguments=call.arguments))
            item = item.model_copy(update={"arguments": call.arguments, "status": "completed"})
            out.append(self.event("response.output_item.done", output_index=len(self.items), item=item.model_dump()))
            self.items.append(item)
        return "".join(out) or None

    def write_text(self, text: str) -> str:
        out = []
        if self.message is None:
            self.message = OutputMessage(id=item_id("msg"), status="in_progress", content=[])
            out.append(self.event("response.output_item.added", output_index=len(self.items),
                                  item=self.message.model_dump()))
            out.append(self.event("response.content_part.added", item_id=self.message.id,
                                  output_index=len(self.items), content_index=0, part=OutputText(text="").model_dump()))
            self.message.content.append(OutputText(text=""))
        self.message.content[0].text += text
        out.append(self.event("response.output_text.delta", item_id=self.message.id, output_index=len(self.items),
                              content_index=0, delta=text, logprobs=[]))
        return "".join(out)

    def close_message(self) -> str:
        message, self.message = self.message, None
        if message is None:
            return ""
        part = message.content[0]
        where = {"item_id": message.id, "output_index": len(self.items), "content_index": 0}
        message.status = "completed"
        out = [self.event("response.output_text.done", **where, text=part.text, logprobs=[]),
               self.event("response.content_part.done", **where, part=part.model_dump()),
               self.event("response.output_item.done", output_index=len(self.items), item=message.model_dump())]
        self.items.append(message)
        return "".join(out)

    def on_end(self, completion_tokens: int) -> str:
        out = [self.write_text("")] if not self.items and self.message is None else []  # an empty answer
        out.append(self.close_message())
        final = self.final or CompletionOutput(0, "", [], None, None, finish_reason="abort")
        response = self.builder.finish(final, self.items, completion_tokens)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        out.append(self.event(kind, response=response.model_dump()))
        return "".join(out)

