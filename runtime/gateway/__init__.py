"""OpenAI-compatible HTTP gateway: a FastAPI process that is a client of the scheduler.

``runtime up`` starts it (``process.py``) when the config has an ``[http]`` table; it runs
``main.py``, which serves ``app.py`` on uvicorn with one long-lived ``runtime.client.Client``.
"""
