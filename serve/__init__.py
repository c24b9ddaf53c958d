"""The Ray Serve application: an OpenAI-compatible HTTP API and a gRPC service, each replica owning one
engine, which it talks to through engine/client.py's EngineClient. ``build_app`` is importable by path
(``serve:build_app``) for ``serve run`` / ``serve deploy``; ``raylm serve`` calls ``serve_until_interrupted``.

Where things are: ``app.py`` the application's options, assembly and start; ``server.py`` the replica (routes,
validation), ``http_app.py`` the FastAPI app its routes hang on and the error bodies, ``served_models.py`` the names
it answers to (its model's and the LoRA adapters') and their cards, ``embeddings.py`` /v1/embeddings' work; ``generation.py`` one request's engine deltas turned into text (by engine/output.py, as offline); ``formats.py`` the SSE chunks and
responses; ``responses.py`` a /v1/responses request's output items and events, and ``response_store.py`` the
responses a replica keeps for ``previous_response_id``; ``http_io.py`` body reading, JSON responses and a request run through
an ASGI app; ``grpc_replies.py`` gRPC messages and status codes; ``protocol/`` the request and response models (a module per job);
``model_router.py`` the ingress of an app serving several models, which forwards each request to its model's
deployment; ``lora_registry.py`` the LoRA adapters every replica of a deployment holds (loads and unloads at
run time reach them all); ``metrics.py`` Prometheus;
``pd.py`` prefill/decode disaggregation (``pd``): the prefill deployment and the decode replica's engine that
splits requests between them; ``ingress.py`` the Ray Serve settings of the streaming path, which the process starting Serve sets before it
imports this package (``use_fast_ingress``); ``lifecycle.py`` stop signals and HAProxy's lifetime; ``drain.py``
a stopping replica's drain.
"""

import importlib

# Resolved on first use: importing a module of this package (ingress.py above all) must not import ray.serve.
__all__ = ["APP_NAME", "AppArgs", "build_app", "deployment_options", "serve_until_interrupted", "start", "wait_healthy"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'serve' has no attribute {name!r}")
    return getattr(importlib.import_module("serve.app"), name)
