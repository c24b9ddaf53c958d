"""The engine's assembly, one job per module (docs/architecture.md draws it).

``interface`` the interface both executors implement; ``request_check`` the one check of a request at the
engine boundary; ``inprocess`` the in-process executor (no Ray); ``ray_client`` the Ray executor, with
``streams`` its async side, ``connect`` joining or starting Ray, ``placement`` its bundles and their errors,
``startup`` its worker actors and process group, ``health`` naming lost ranks; ``network`` interfaces and ports.

Nothing is imported here: the in-process executor must load where Ray is not installed.
"""
