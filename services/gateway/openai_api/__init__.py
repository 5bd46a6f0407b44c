"""The OpenAI-compatible HTTP API of the gateway (Starlette on uvicorn, in the gateway's
own process and event loop, sharing its `GatewayCore`: one routing implementation).

| file | role |
|---|---|
| `fields.py` | OpenAI JSON body -> `GenRequest` + response options; every bad field -> `InvalidArgument` naming it |
| `chat.py` | chat messages -> prompt text: a plain template for the byte-level model, or the tokenizer config's Jinja `chat_template` |
| `render.py` | `Chunk`s and `Usage` -> OpenAI JSON objects and server-sent events; errors -> OpenAI's error shape and HTTP status |
| `app.py` | routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`), body limit, client disconnects |
| `server.py` | uvicorn started inside the running event loop, stopped with the gateway |
"""
