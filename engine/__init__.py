"""The engine's assembly, one module per job (docs/architecture.md lists them). Nothing is imported here: the
in-process executor must load where Ray is not installed."""
