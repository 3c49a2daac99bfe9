"""The HTTP APIs' request shapes, each with its one translation into sampling parameters:
OpenAI's (openai.py) and SGLang's (sglang.py), what they share (common.py), tool calling
(tools.py), and the OpenAI response bodies (responses.py); shared by the server and offline
batch runs."""
