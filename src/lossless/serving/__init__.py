"""`lossless serve`: an OpenAI-compatible HTTP server over one model (FastAPI + uvicorn).

    from lossless.serving import create_app, Defaults
    app = create_app(load_model("smollm2-135m"), Defaults(max_tokens=512))   # an ASGI app
"""

from .app import Defaults, create_app

__all__ = ["create_app", "Defaults"]
