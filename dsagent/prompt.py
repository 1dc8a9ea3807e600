"""The agent's default system prompt, in a module of its own: the corpus generator and the
training scripts read it without importing the agent (and with it the session store, whose
packages the GPU machine lacks)."""

DEFAULT_SYSTEM = ("You are dsagent, a local assistant running a DeepSeek-V4.1-style model. "
                  "Answer briefly. Use a tool when it helps, then answer from its result.")
