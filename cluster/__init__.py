"""Assembly: configs, engines, the offline LLM API, the Serve app and the CLI."""
