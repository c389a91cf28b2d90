"""Serving: the engine-agnostic router (``router/``) and the toy engine (``toy/``).

The router speaks OpenAI to clients and drives engine workers through one small interface
(``router.backends``); the toy workers are one engine, vLLM another.
"""
