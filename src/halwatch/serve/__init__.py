"""The HTTP servers: ``halwatch serve`` (scoring service, guard proxy, web page) and ``halwatch watch serve-llm``
(a local model behind the OpenAI chat API), on one FastAPI + uvicorn stack (:mod:`halwatch.serve.common`). This is
the top layer: it calls the library, and nothing below imports it."""
