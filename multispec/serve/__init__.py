"""The OpenAI-compatible server (``multispec serve``): FastAPI on an ``AsyncLLM``, so requests that
arrive while others run join the same batch, and the n samples of each draft for each other.

``multispec.serve.app.build_app(AsyncLLM(LLM(...)), ServerConfig("name"))`` gives the ASGI app;
``multispec serve`` (``multispec.serve.cli``) builds it from the command line and runs it with
uvicorn. Nothing is imported here, so the command line stays quick to start.
"""
