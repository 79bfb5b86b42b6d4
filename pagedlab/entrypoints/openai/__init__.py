"""The OpenAI-compatible server: request bodies (`protocol`), the two endpoints (`serving_completion`,
`serving_chat`) over their shared parts (`serving_engine`), and the FastAPI app (`api_server`).

# Explained in chapters/13_serving.ipynb
"""
