"""HalMit (Liu et al.): a black-box watchdog for an LLM agent. It explores the agent's generalization bound with
fractal query generation (``explore``), keeps the boundary points in a vector store (``store``) and checks new
queries against them (``monitor``, Algorithm 1)."""
