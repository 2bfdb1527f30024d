"""The router's HTTP side: the FastAPI app and the OpenAI API (validation, chat templates,
tokenization, fan-out of the choices, formatting, SSE), over a `pdserve.router.backend.GenerationBackend`.

It imports nothing of router.cluster: the backend interface (router.backend), the errors
(router.errors) and the metrics (router.metrics) are shared by both sides.
"""
