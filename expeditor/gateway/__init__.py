"""The OpenAI-compatible HTTP gateway in front of the scheduler (``expeditor gateway``)."""
