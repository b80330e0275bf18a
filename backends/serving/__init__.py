"""The HTTP dialect: the FastAPI app, chat + completions, tool-call parsing, `trajflow serve`, the dialect
clients, the vLLM launcher. Never imports training."""
