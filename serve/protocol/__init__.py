"""The OpenAI-compatible wire format, one module per job: ``parsing`` (error bodies, APIError, a body validated
into a request model, the shared field types), ``sampling`` (the fields completions and chat share, mapped onto
SamplingParams), ``output`` (ids, usage, the stream chunk's base), ``completions``, ``chat``, ``tokenize``
(vLLM's /tokenize and /detokenize) and ``models``. Import each name from its module."""
