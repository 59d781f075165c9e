"""HTTP layer of deltaserve: OpenAI- and Anthropic-compatible routes over an EngineClient.
No MLX here.

Map of the package:

- settings:           config.yaml / env / flags -> frozen Settings (one section per layer).
- app:                create_app(engine, tokenizer, settings): routers, auth, CORS, lifespan.
- schemas:            pydantic request models (validation).
- responses:          pydantic response models (the OpenAI spec's shapes).
- errors:             APIError and the handlers: OpenAI's error shape, Anthropic's on /v1/messages.
- pipeline:           the one route shape: serve(), the Writer protocol, OutputSpec.
- prompts:            chat prompts for chat and messages: images + template -> token ids.
- routes_chat:        POST /v1/chat/completions (adapter + ChatWriter).
- routes_completions: POST /v1/completions (adapter + CompletionWriter).
- routes_models:      GET /v1/models, /health, /metrics.
- routes_common:      server state, model check, body parsing, field names, SamplingParams.
- routes_generation:  GenerationRun/RunGroup: engine outputs -> per-choice events.
- images:             image_url parts -> decoded, limited, preprocessed ImageInputs.
- sse:                SSE framing, keep-alive ticks, in-band stream errors.
- metrics:            Prometheus metrics (per-request and engine gauges at scrape time).
- frontend/:          tokenizer, chat template, detokenization, stops, reasoning, tools.
- cli:                `deltaserve serve`.
"""

if __name__ != "deltaserve.server":  # one name per module (deltaserve/__init__.py)
    raise ImportError(f"{__name__}: this folder imports as deltaserve.server only")
