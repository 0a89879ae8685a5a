"""Ollama's API (``/api/*``) on ``celeris serve``: the official ``ollama`` clients and the tools built on them talk to
Celeris unchanged. ``protocol``: the request and response shapes; ``serving``: translation into the OpenAI serving
layer's requests (one request path: limits, errors, metrics, grammars and tool calls are the chat and completions
routes' own); ``routes``: the thin routes, NDJSON streaming and Ollama's error shape."""
