"""API request shapes, read and converted to the OpenAI chat shape, below the proxy and rewards.

- `anthropic`: an Anthropic Messages request validated and converted (messages, tools, tool_choice).
- `recorded`: the OpenAI-shaped view of a request as the store recorded it, for any API.
- `errors`: `ShapeError`, what a refused request raises (the proxy answers it as a 400).

Invariant: nothing here imports the proxy, the store or the rewards; they import this.
"""
