"""HTTP layer of deltaserve: OpenAI-compatible routes over an EngineClient. No MLX here.

Map of the package:

- settings:           config.yaml / env / flags -> frozen Settings (one section per layer).
- app:                create_app(engine, tokenizer, settings): routers, auth, CORS, lifespan.
- schemas:            pydantic request models (validation).
- responses:          pydantic response models (the OpenAI spec's shapes).
- errors:             APIError and the handlers that give every failure OpenAI's error shape.
- routes_chat:        POST /v1/chat/completions.
- routes_completions: POST /v1/completions.
- routes_models:      GET /v1/models, /health, /metrics.
- routes_common:      server state, model check, body parsing, SamplingParams, disconnects.
- routes_generation:  GenerationRun: engine outputs -> per-choice events via the frontend.
- images:             image_url parts -> decoded, limited, preprocessed ImageInputs.
- sse:                SSE framing, keep-alive ticks, in-band stream errors.
- metrics:            Prometheus metrics (per-request and engine gauges at scrape time).
- frontend/:          tokenizer, chat template, detokenization, stops, reasoning, tools.
- cli:                `deltaserve serve`.
"""
