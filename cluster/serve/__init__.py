"""The Ray Serve application: an OpenAI-compatible HTTP API and a gRPC service, each replica owning one
RayEngine. ``build_app`` is importable by path (``cluster.serve:build_app``) for ``serve run`` /
``serve deploy``; ``raylm serve`` calls ``serve_until_interrupted``.

Where things are: ``app.py`` the application's options, assembly and start; ``server.py`` the replica
(routes, validation); ``generation.py`` one request's engine deltas turned into text; ``formats.py`` the
SSE chunks and responses; ``http_io.py`` body reading and JSON responses; ``grpc_status.py`` the gRPC status
mapping; ``protocol.py`` the request and response models; ``detokenize.py`` incremental text and stop
strings; ``metrics.py`` Prometheus; ``ingress.py`` the Ray Serve settings of the streaming path;
``lifecycle.py`` stop signals and HAProxy's lifetime; ``drain.py`` a stopping replica's drain.
"""

from cluster.serve.ingress import use_fast_ingress

use_fast_ingress()  # before anything imports ray.serve, whose settings are read at import

from cluster.serve.app import (  # noqa: E402
    APP_NAME, AppArgs, build_app, deployment_options, serve_until_interrupted, start, wait_healthy,
)

__all__ = ["APP_NAME", "AppArgs", "build_app", "deployment_options", "serve_until_interrupted", "start",
           "use_fast_ingress", "wait_healthy"]
