"""`jaxllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the inference
engine (`jaxllm.infer.engine`). `worker` steps the engine in one background thread, `app` holds
the routes, `cli` loads a run and starts uvicorn. Needs the `serve` extra."""
