"""HTTP serving: Starlette apps per role, the router, and the `pdengine serve|prefill|decode|router`
commands. See docs/api.md for the API.

- `app`: app factories for the colocated engine and the prefill / decode workers
  (`router_app` for the router); each `lifespan` owns its engine, worker or router.
- `openai_api`, `generate_api`, `worker_api`, `common_api`: thin endpoint functions.
- `generation` (`Backend`, `RequestRun`), `serving`, `sse`: one request from endpoint to
  back-end and back, JSON or server-sent events, abort on disconnect.
- `router`: `RouterBackend`, pair selection, dispatch to prefill + decode, one retry.
- `params`, `body`, `auth`, `errors`, `openapi`: validation, limits, API key, error JSON,
  the OpenAPI document.
- `launch`, `supervisor`: command line, uvicorn, the child processes of `pdengine serve`.
- `internal` (workers' `/internal/*` routes), `probe`, `bench_cli`, `diagnostics_*`: written
  with the workers and the diagnostics tools.
"""
