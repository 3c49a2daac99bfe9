"""The HTTP APIs' request schemas (OpenAI's and SGLang's) with their translation into sampling
parameters, and the OpenAI response bodies: shared by the server and offline batch runs."""
